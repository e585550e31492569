"""Imported into a `stapo train` (``--import``) by tests/vllm_cpu/test_vllm_server_faults.py: the trainer signals
itself inside the weight sync that makes policy version ``AT_VERSION``, after every bucket went out and before
the commit. ``STAPO_LANE_MID_SYNC=kill`` (the default): SIGKILL — what a trainer node lost mid-sync leaves
behind: a session open on every server, its bytes staged there, nothing committed. ``stop``: SIGSTOP — frozen
mid-sync until the test sends SIGCONT (after killing a server). Deterministic, where freezing a running
trainer at the right moment from outside is not (a sync of the tiny model is a fraction of a second)."""

from __future__ import annotations

import os
import signal

from stapo.servers.engine import ServerEngine

AT_VERSION = 2  # the sync after step 2: step 1's checkpoint is on disk by then
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_close_session = ServerEngine._close_session


def _close_session_after_a_signal(self, version: int):
    if version == AT_VERSION:
        os.kill(os.getpid(), SIGNALS[os.environ.get("STAPO_LANE_MID_SYNC", "kill")])
    return _close_session(self, version)


ServerEngine._close_session = _close_session_after_a_signal
