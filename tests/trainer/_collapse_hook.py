"""Imported into a `stapo train` (``--import``) by tests/trainer/test_rollback.py: a collapse on demand.

The updates of iteration ``STAPO_TEST_SPIKE_STEP`` run at ``SPIKE_FACTOR`` times the learning rate (the
schedule's base lr, so every mini-batch of that iteration gets it), which wrecks the tiny policy; the next
iterations run at the normal lr again. With ``STAPO_TEST_KILL_IN_ROLLBACK=1`` the process SIGKILLs itself
inside the rollback, right after the healthy checkpoint was restored and before anything was saved —
what a node lost mid-rollback leaves behind. Deterministic, where killing from outside at that moment is not.
"""

from __future__ import annotations

import os
import signal

from stapo.distributed.deepspeed_engine import base_lrs, set_base_lrs
from stapo.trainer import recovery
from stapo.trainer.trainer import STAPOTrainer

SPIKE_STEP = int(os.environ.get("STAPO_TEST_SPIKE_STEP", "6"))
SPIKE_FACTOR = 3000.0
_step, _restore = STAPOTrainer.step, recovery.restore


def _step_with_spike(self):
    if self.step_count + 1 != SPIKE_STEP:
        return _step(self)
    normal = base_lrs(self.engine)
    set_base_lrs(self.engine, [lr * SPIKE_FACTOR for lr in normal])
    try:
        return _step(self)
    finally:
        set_base_lrs(self.engine, normal)


def _restore_then_die(trainer, path):
    state = _restore(trainer, path)
    os.kill(os.getpid(), signal.SIGKILL)
    return state


STAPOTrainer.step = _step_with_spike
if os.environ.get("STAPO_TEST_KILL_IN_ROLLBACK") == "1":
    recovery.restore = _restore_then_die
