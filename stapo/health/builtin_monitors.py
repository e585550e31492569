"""The built-in monitors; docs/health.md, "Monitors", has the table (statistic, threshold, what each watches
for), the floored robust z-score and how the defaults were set.
"""

from __future__ import annotations

import statistics

from stapo.health.monitors import MIN_HISTORY, Window, register_monitor, robust_z


def _robust_z_monitor(name: str, key: str, *, doc: str, floor: float = 0.0, abs_floor: float = 0.0,
                      two_sided: bool = False) -> None:
    """Register monitor ``name``: the robust z of ``key`` (|z| if ``two_sided``), its threshold ``z``; its
    scale floor, relative (``floor``) or absolute (``abs_floor``), is the parameter it is given."""
    def statistic(z: float | None) -> float | None:
        return abs(z) if two_sided and z is not None else z

    if floor:
        def monitor(window: Window, z: float = 6.0, floor: float = floor) -> float | None:
            return statistic(robust_z(window, key, rel_floor=floor))
    else:
        def monitor(window: Window, z: float = 6.0, abs_floor: float = abs_floor) -> float | None:
            return statistic(robust_z(window, key, abs_floor=abs_floor))
    monitor.__doc__, monitor.__name__, monitor.__qualname__ = doc, name, name
    register_monitor(name, reads=(key,), threshold="z", fires="above")(monitor)


@register_monitor("entropy_collapse", reads=("entropy_mean",), threshold="ratio", fires="below")
def entropy_collapse(window: Window, ratio: float = 0.5) -> float | None:
    """Entropy falling fast: ``entropy_mean`` over the median of its window (half of it: a collapse)."""
    x, past = window.current("entropy_mean"), window.history("entropy_mean")
    if x is None or len(past) < MIN_HISTORY:
        return None
    baseline = statistics.median(past)
    return x / baseline if baseline > 0 else None


_robust_z_monitor("entropy_blowup", "entropy_mean", floor=0.1,
    doc="Entropy exploding: robust z of ``entropy_mean``; the policy turning to noise.")
_robust_z_monitor("spurious_tokens", "spurious_frac", abs_floor=1e-4,
    doc="More tokens meeting STAPO's S2T criterion: robust z of ``spurious_frac`` (their share is the signal).")
_robust_z_monitor("ratio_tail", "mismatch_logp_abs_max", abs_floor=0.5,
    doc="The importance ratios' tail: robust z of ``mismatch_logp_abs_max`` (sampler vs trainer, nats).")


@register_monitor("is_ess", reads=("rollout_is_eff_sample_size",), threshold="level", fires="below")
def is_ess(window: Window, level: float = 0.5) -> float | None:
    """Importance weights concentrating: ``rollout_is_eff_sample_size`` (only with ``loss.rollout_is``)."""
    return window.current("rollout_is_eff_sample_size")


_robust_z_monitor("mismatch_kl", "mismatch_kl", abs_floor=2e-4,
    doc="The rollout-trainer mismatch jumping: robust z of ``mismatch_kl`` (k3 KL(sampler || trainer)).")
_robust_z_monitor("grad_norm", "grad_norm", floor=0.1,
    doc="Gradient-norm spike: robust z of ``grad_norm`` (pre-clip, mean over the step's updates).")
_robust_z_monitor("update_kl", "approx_kl", abs_floor=1e-3,
    doc="Updates growing: robust z of ``approx_kl`` (PPO's early-stop signal).")


@register_monitor("reward_drop", reads=("accuracy",), threshold="drop", fires="above")
def reward_drop(window: Window, drop: float = 0.1, span: int = 10) -> float | None:
    """Training accuracy falling: best ``span``-step mean of ``accuracy`` in the window minus the last one."""
    x = window.current("accuracy")
    values = [*window.history("accuracy"), x]
    if x is None or len(values) < 2 * span:
        return None
    means = [statistics.fmean(values[i:i + span]) for i in range(len(values) - span + 1)]
    return max(means) - means[-1]


@register_monitor("clip_frac", reads=("clip_frac_low", "clip_frac_high"), threshold="z", fires="above")
def clip_frac(window: Window, z: float = 6.0, abs_floor: float = 0.005) -> float | None:
    """Updates leaving the trust region: robust z of ``clip_frac_low`` + ``clip_frac_high``."""
    both = [{"clip": r["clip_frac_low"] + r["clip_frac_high"]} if "clip_frac_low" in r and "clip_frac_high" in r
            else {} for r in window.rows]
    return robust_z(Window(both), "clip", abs_floor=abs_floor)


_robust_z_monitor("zero_std_groups", "zero_std_group_frac", abs_floor=0.05,
    doc="Groups with no learning signal piling up: robust z of ``zero_std_group_frac``.")
_robust_z_monitor("response_length", "response_length_mean", floor=0.05, two_sided=True,
    doc="Responses collapsing or running away: |robust z| of ``response_length_mean``.")
_robust_z_monitor("truncation", "response_clip_ratio", abs_floor=0.02,
    doc="More responses cut at ``rollout.max_response_length``: robust z of ``response_clip_ratio``.")
_robust_z_monitor("repetition", "repetition_frac", abs_floor=0.02,
    doc="Responses looping: robust z of ``repetition_frac`` (tokens closing a repeated 4-gram).")
_robust_z_monitor("tool_errors", "tool_error_frac", abs_floor=0.05,
    doc="Tool episodes: robust z of ``tool_error_frac`` (failed calls per call).")
_robust_z_monitor("tool_calls", "tool_calls_mean", floor=0.1, two_sided=True,
    doc="Tool episodes: calls per episode collapsing or running away: |robust z| of ``tool_calls_mean``.")
_robust_z_monitor("control_tokens", "control_token_frac", floor=0.1, two_sided=True,
    doc="Tool episodes: the format's control tokens emitted more or less often: |robust z| of ``control_token_frac``.")
_robust_z_monitor("control_token_prob", "control_token_prob", abs_floor=0.02, two_sided=True,
    doc="Tool episodes: the probability of the emitted control tokens moving: |robust z| of ``control_token_prob``.")
