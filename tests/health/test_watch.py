"""HealthWatch: patience, one alarm per streak, onsets, warm-up, and which checkpoints are healthy."""

from __future__ import annotations

from stapo.health import HealthWatch, build_monitor, metric_key


def _watch(**kw) -> HealthWatch:
    kw = {"window": 10, "warmup": 3, "patience": 3, **kw}
    return HealthWatch([build_monitor("grad_norm", z=6.0)], **kw)


def _feed(watch: HealthWatch, values: dict[int, float]) -> dict[int, list]:
    """Observe ``{step: grad_norm}`` in order; the alarms by step."""
    return {step: watch.observe(step, {"grad_norm": value})[1] for step, value in values.items()}


def _normal(steps) -> dict[int, float]:
    return {s: 1.0 + 0.01 * (s % 3) for s in steps}  # median 1.01, floor 0.1 x median: a spike needs > 1.6


def test_warmup_then_one_alarm_per_streak_with_its_onset():
    watch = _watch()
    assert watch.observe(1, {"grad_norm": 50.0}) == ({}, [])  # warm-up: nobody judges yet
    alarms = _feed(watch, {**_normal(range(2, 10)), 10: 9.0, 11: 9.0, 12: 9.0, 13: 9.0, 14: 1.0, 15: 9.0})
    fired = [(s, a.onset, a.monitor) for s, found in alarms.items() for a in found]
    assert fired == [(12, 10, "grad_norm")]  # 3 steps from the onset at 10; 13 stays in the same alarm
    assert watch.streak == {"grad_norm": 1} and watch.onset == {"grad_norm": 15}  # 14 ended it, 15 starts over
    assert metric_key("grad_norm") == "health_grad_norm"


def test_two_short_streaks_do_not_add_up():
    watch = _watch()
    alarms = _feed(watch, {**_normal(range(1, 10)), 10: 9.0, 11: 9.0, 12: 1.0, 13: 9.0, 14: 9.0, 15: 1.0})
    assert not any(alarms.values()) and watch.quiet


def test_a_checkpoint_is_healthy_once_the_step_its_weights_made_is_quiet():
    watch = _watch(keep_healthy=2)
    _feed(watch, _normal(range(1, 6)))
    watch.checkpoint_saved(5)
    assert watch.healthy == [] and watch.protected() == (5,)  # a candidate: spared by pruning, not yet healthy
    _feed(watch, _normal([6]))
    assert watch.healthy == [5] and watch.candidate is None
    watch.checkpoint_saved(6)
    _feed(watch, {7: 9.0})  # the weights of step 6 made step 7 sick: 6 never becomes healthy
    assert watch.healthy == [5] and watch.candidate is None
    watch.checkpoint_saved(7)  # saved during a streak: not even a candidate
    assert watch.candidate is None
    alarms = _feed(watch, {8: 9.0, 9: 9.0})
    assert watch.rollback_target(alarms[9]) == 5


def test_rollback_target_needs_a_healthy_checkpoint_before_the_onset():
    watch = _watch(keep_healthy=3)
    _feed(watch, _normal(range(1, 4)))
    watch.checkpoint_saved(3)
    alarms = _feed(watch, {4: 9.0, 5: 9.0, 6: 9.0})
    assert watch.healthy == [] and watch.rollback_target(alarms[6]) is None  # 3 made step 4: the onset
    watch.restored(2)  # a rollback restored step_2 (with that checkpoint's state)
    assert watch.healthy == [2] and watch.candidate is None


def test_keep_healthy_keeps_the_newest():
    watch = _watch(keep_healthy=2)
    for step in range(1, 12):
        _feed(watch, _normal([step]))
        watch.checkpoint_saved(step)
    assert watch.healthy == [9, 10] and watch.protected() == (9, 10, 11)


def test_state_round_trip_and_an_old_checkpoint_without_health():
    watch = _watch()
    _feed(watch, {**_normal(range(1, 10)), 10: 9.0})
    watch.checkpoint_saved(10)
    watch.rollbacks = 2
    copy = _watch()
    copy.load_state_dict(watch.state_dict())
    assert copy.state_dict() == watch.state_dict()
    copy.load_state_dict(None)  # a checkpoint from before health monitoring
    assert (copy.rows, copy.healthy, copy.rollbacks, copy.quiet) == ([], [], 0, True)
