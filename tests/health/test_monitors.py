"""Every built-in monitor on constructed metric streams: silent on noise of the stated size, an alarm on
its pattern at the step patience predicts; plus the robust z-score by hand and the registry's rules."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from stapo.health import (BUILTIN_MONITORS, MONITORS, HealthWatch, Window, build_monitor, monitor_params,
                          register_monitor, robust_z)

PATIENCE, WARMUP, QUIET_STEPS = 3, 10, 300


def _noise(level: float, sigma: float, low: float = 0.0, high: float = math.inf):
    """Gaussian noise of ``sigma`` around ``level``, clipped to [low, high] (fractions stay fractions)."""
    return lambda rng, i: min(max(rng.gauss(level, sigma), low), high)


#: monitor -> (its metric key(s), the noise it must sit through, the value of its pattern). The noise is
#: of the size the docstrings state the monitor tolerates; the pattern is what it exists to catch.
CASES = {
    "entropy_collapse": ({"entropy_mean": _noise(0.10, 0.01)}, {"entropy_mean": 0.03}),
    "entropy_blowup": ({"entropy_mean": _noise(0.10, 0.01)}, {"entropy_mean": 0.6}),
    "spurious_tokens": ({"spurious_frac": lambda rng, i: rng.choice([0.0, 0.0, 1e-4, 2e-4])},
                        {"spurious_frac": 2e-3}),
    "ratio_tail": ({"mismatch_logp_abs_max": _noise(0.3, 0.1, low=0.0)}, {"mismatch_logp_abs_max": 6.0}),
    "is_ess": ({"rollout_is_eff_sample_size": _noise(0.95, 0.02, high=1.0)}, {"rollout_is_eff_sample_size": 0.3}),
    "mismatch_kl": ({"mismatch_kl": _noise(3e-4, 1e-4, low=0.0)}, {"mismatch_kl": 2e-2}),
    "grad_norm": ({"grad_norm": _noise(0.7, 0.15, low=0.0)}, {"grad_norm": 6.0}),
    "update_kl": ({"approx_kl": _noise(3e-3, 1e-3, low=0.0)}, {"approx_kl": 0.05}),
    "reward_drop": ({"accuracy": _noise(0.6, 0.07, 0.0, 1.0)}, {"accuracy": 0.2}),
    "clip_frac": ({"clip_frac_low": _noise(0.002, 0.001, low=0.0), "clip_frac_high": _noise(0.002, 0.001, low=0.0)},
                  {"clip_frac_low": 0.05, "clip_frac_high": 0.05}),
    "zero_std_groups": ({"zero_std_group_frac": _noise(0.3, 0.08, 0.0, 1.0)}, {"zero_std_group_frac": 1.0}),
    "response_length": ({"response_length_mean": _noise(35.0, 1.0)}, {"response_length_mean": 8.0}),
    "truncation": ({"response_clip_ratio": lambda rng, i: rng.choice([0.0, 0.0, 0.0, 0.004, 0.016])},
                   {"response_clip_ratio": 0.5}),
    "repetition": ({"repetition_frac": _noise(0.05, 0.01, low=0.0)}, {"repetition_frac": 0.6}),
    "tool_errors": ({"tool_error_frac": _noise(0.1, 0.03, 0.0, 1.0)}, {"tool_error_frac": 0.9}),
    "tool_calls": ({"tool_calls_mean": _noise(1.5, 0.1, low=0.0)}, {"tool_calls_mean": 5.0}),
    "control_tokens": ({"control_token_frac": _noise(0.05, 0.005, low=0.0)}, {"control_token_frac": 0.005}),
    "control_token_prob": ({"control_token_prob": _noise(0.9, 0.02, high=1.0)}, {"control_token_prob": 0.3}),
}


def _watch(name: str) -> HealthWatch:
    return HealthWatch([build_monitor(name)], window=50, warmup=WARMUP, patience=PATIENCE)


def test_every_builtin_has_a_case_and_a_documented_threshold():
    assert set(CASES) == set(BUILTIN_MONITORS)
    for name in BUILTIN_MONITORS:
        fn = MONITORS[name]
        assert fn.threshold_param in monitor_params(name) and fn.fires in ("above", "below")
        assert fn.__doc__ and all(f"``{key}``" in fn.__doc__ for key in fn.reads), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_silent_on_noise_then_an_alarm_on_the_pattern(name):
    noise, pattern = CASES[name]
    rng, watch = random.Random(0), _watch(name)
    for step in range(1, QUIET_STEPS + 1):
        values, alarms = watch.observe(step, {key: make(rng, step) for key, make in noise.items()})
        assert not alarms, (name, step, values)
    steps = range(QUIET_STEPS + 1, QUIET_STEPS + 13)  # the pattern holds for 12 steps: one alarm
    fired = [alarm for step in steps for alarm in watch.observe(step, pattern)[1]]
    assert len(fired) == 1, (name, fired)
    (alarm,) = fired
    # a statistic of the current step crosses at once: the alarm comes on the patience-th step; reward_drop's
    # mean over its last 10 steps (best in the noise: ~0.63) crosses 0.1 below that on the 2nd step at 0.2
    delay = 1 if name == "reward_drop" else 0
    assert (alarm.monitor, alarm.onset, alarm.step) == (name, QUIET_STEPS + 1 + delay, QUIET_STEPS + PATIENCE + delay)
    assert build_monitor(name).past_threshold(alarm.value)


def test_robust_z_by_hand():
    # history 1, 2, 3, 4, 100: median 3, |x - 3| = 2, 1, 0, 1, 97 -> MAD 1 -> scale 1.4826
    rows = [{"x": v} for v in (1.0, 2.0, 3.0, 4.0, 100.0, 9.0)]
    assert robust_z(Window(rows), "x") == pytest.approx((9.0 - 3.0) / 1.4826)
    assert robust_z(Window(rows), "x", rel_floor=1.0) == pytest.approx((9.0 - 3.0) / 3.0)  # floor: |median|
    assert robust_z(Window(rows), "x", abs_floor=10.0) == pytest.approx(0.6)
    assert robust_z(Window(rows[:3]), "x") is None  # 2 earlier values: no baseline
    assert robust_z(Window([{"x": 1.0}] * 5 + [{"x": 2.0}]), "x") == math.inf  # constant history, no floor
    assert robust_z(Window(rows[:-1] + [{}]), "x") is None  # the step did not log it


def test_a_monitor_without_its_metrics_is_silent():
    watch = _watch("tool_calls")  # a run without tools never logs tool_calls_mean
    for step in range(1, 40):
        assert watch.observe(step, {"entropy_mean": 0.1}) == ({}, [])


def test_user_monitor_registration_and_parameters():
    @register_monitor("test_kl_spike", reads=("kl",), threshold="z", fires="above")
    def kl_spike(window, z: float = 6.0, floor: float = 1e-3):
        """KL to the reference jumping: robust z of ``kl``."""
        return robust_z(window, "kl", abs_floor=floor)

    try:
        monitor = build_monitor("test_kl_spike", z=4.0)
        assert (monitor.threshold, monitor.params, monitor.reads) == (4.0, {"z": 4.0, "floor": 1e-3}, ("kl",))
        with pytest.raises(ValueError, match=r"has no parameter\(s\) \['zz'\]; its parameters: \['floor', 'z'\]"):
            build_monitor("test_kl_spike", zz=1)
        with pytest.raises(ValueError, match="no parameter 'level'"):
            register_monitor("test_bad", reads=("kl",), threshold="level", fires="above")(kl_spike)
        with pytest.raises(ValueError, match="fires must be one of"):
            register_monitor("test_bad", reads=("kl",), threshold="z", fires="up")
    finally:
        del MONITORS["test_kl_spike"]
    with pytest.raises(ValueError, match="unknown health monitor 'nope'; choose one of"):
        build_monitor("nope")


def test_reward_drop_by_hand():
    # 20 steps at 0.6 then 10 at 0.3: best 10-step mean 0.6, last 0.3 -> drop 0.3
    rows = [{"accuracy": 0.6}] * 20 + [{"accuracy": 0.3}] * 10
    assert build_monitor("reward_drop").statistic(Window(rows)) == pytest.approx(0.3)
    assert build_monitor("reward_drop").statistic(Window(rows[:19])) is None  # fewer than 2 spans


def test_watch_state_is_json_and_replays_identically():
    rng = random.Random(3)
    stream = [{"grad_norm": rng.gauss(0.7, 0.15), "entropy_mean": 0.1 - 0.0005 * i} for i in range(80)]
    stream[60:65] = [{**row, "grad_norm": 9.0} for row in stream[60:65]]
    monitors = [build_monitor("grad_norm"), build_monitor("entropy_collapse")]
    whole = HealthWatch(monitors, window=20, warmup=5, patience=2)
    first = [whole.observe(i + 1, row) for i, row in enumerate(stream)]
    half = HealthWatch(monitors, window=20, warmup=5, patience=2)
    for i, row in enumerate(stream[:55]):
        half.observe(i + 1, row)
    resumed = HealthWatch(monitors, window=20, warmup=5, patience=2)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))  # a checkpoint's meta.json holds it
    second = [resumed.observe(i + 1, row) for i, row in enumerate(stream[55:], start=55)]
    assert second == first[55:]
    assert [a.monitor for _, alarms in first for a in alarms] == ["grad_norm"]
    assert statistics.median(v["health_grad_norm"] for v, _ in first[10:55]) < 1.0
