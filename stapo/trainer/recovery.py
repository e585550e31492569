"""What a health alarm does (``health.on_alarm``): warn, stop (exit status 3), or roll back to the newest
healthy checkpoint while the data order and random streams go on (docs/health.md, "Alarms and actions").
"""

from __future__ import annotations

import logging
from pathlib import Path

from stapo.distributed.deepspeed_engine import base_lrs, current_lr, set_base_lrs
from stapo.distributed.process_group import broadcast_object
from stapo.health import Alarm, HealthWatch
from stapo.run_dir import checkpoint_name
from stapo.trainer.interrupt import HealthStop

__all__ = ["Recovery", "restore"]

log = logging.getLogger("stapo.trainer")


def restore(trainer, path: Path, rng: bool = False) -> dict:
    """Load checkpoint ``path`` into the trainer (weights, optimizer, lr, mask; the RNG with ``rng``); returns
    its client state."""
    state = trainer.checkpoints.load(trainer.engine, path, restore_rng=rng)
    trainer.mask.load_state_dict(state.get("mask", {}))
    return state


class Recovery:
    """The trainer's health: its :class:`HealthWatch` and the actions of ``health.on_alarm``."""

    def __init__(self, trainer, watch: HealthWatch) -> None:
        self.trainer, self.watch = trainer, watch
        self.settings = trainer.config.health
        self._announced = False

    def observe(self, metrics: dict) -> list[Alarm]:
        """Run the monitors on ``metrics`` (their statistics join it); rank 0's new alarms on every rank."""
        t = self.trainer
        if not self._announced:  # each session's first row: the monitors and thresholds (`stapo health`)
            t.logger.log_event(t.step_count, "health", {"on_alarm": self.settings.on_alarm,
                                                        "patience": self.watch.patience,
                                                        "monitors": self.watch.thresholds()})
            self._announced = True
        values, alarms = self.watch.observe(t.step_count, metrics)
        metrics.update(values)
        return broadcast_object(alarms) if t.dist.world_size > 1 else alarms

    def respond(self, alarms: list[Alarm]) -> bool:
        """Act on the step's alarms; True when that saved a checkpoint (the loop's periodic save is then done)."""
        t, h = self.trainer, self.settings
        action, note, target = h.on_alarm, "", None
        if action == "rollback":
            target = self.watch.rollback_target(alarms) if self.watch.rollbacks < h.max_rollbacks else None
            if t.dist.world_size > 1:
                target = broadcast_object(target)
            if target is None:
                onset = min(a.onset for a in alarms)
                action, note = "warn", (f"health.max_rollbacks={h.max_rollbacks} reached"
                                        if self.watch.rollbacks >= h.max_rollbacks else
                                        f"no healthy checkpoint was saved before the onset at step {onset}")
        for alarm in alarms:
            log.warning("%s: %s%s", alarm.describe(), action, f" ({note})" if note else "")
            t.logger.log_event(t.step_count, "alarm", {
                "monitor": alarm.monitor, "value": alarm.value, "threshold": alarm.threshold, "fires": alarm.fires,
                "onset": alarm.onset, "action": action, **({"note": note} if note else {})})
        if action == "stop":
            self._stop(alarms)
        if action == "rollback":
            self._rollback(target, alarms)
            return True
        return False

    def _stop(self, alarms: list[Alarm]) -> None:
        t = self.trainer
        saved = t.save_checkpoint()
        t.logger.log_event(t.step_count, "stop", {"checkpoint": str(saved)})
        t.logger.close()
        t._close_scorer()
        names = ", ".join(a.monitor for a in alarms)
        raise HealthStop(f"health alarm ({names}; health.on_alarm=stop)", t.step_count, saved)

    def _rollback(self, target: int, alarms: list[Alarm]) -> None:
        t, h = self.trainer, self.settings
        lrs, rollbacks, lr_before = base_lrs(t.engine), self.watch.rollbacks + 1, current_lr(t.engine)
        state = restore(t, t.checkpoints.root / checkpoint_name(target))
        self.watch.load_state_dict(state.get("health"))  # the window, streaks and healthy list of then
        self.watch.restored(target)
        self.watch.rollbacks = rollbacks  # ... but the count goes on
        set_base_lrs(t.engine, [lr * h.rollback_lr_scale for lr in lrs])
        t._consecutive_skips = 0
        t.rollouts.sync(t.step_count)  # the rollout engine samples with the restored weights from now on
        onset = min(a.onset for a in alarms)
        log.warning("rollback %d of %d at step %d: restored checkpoint %s (saved before the onset at step %d), "
                    "lr %.3g -> %.3g; the data of steps %d-%d is not replayed", rollbacks, h.max_rollbacks,
                    t.step_count, checkpoint_name(target), onset, lr_before, current_lr(t.engine), target + 1,
                    t.step_count)
        t.logger.log_event(t.step_count, "rollback", {
            "restored_step": target, "onset": onset, "monitors": [a.monitor for a in alarms],
            "lr": current_lr(t.engine), "rollbacks": rollbacks, "skipped_batches": t.step_count - target})
        t.save_checkpoint()
