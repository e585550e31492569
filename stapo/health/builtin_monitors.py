"""The built-in monitors; docs/health.md, "Monitors", has the table (statistic, threshold, what each watches
for) and how the defaults were set. Robust z-scores floor their scale (``floor`` relative, ``abs_floor``
absolute) so a nearly constant metric does not turn a wobble into a spike; two-sided ones return |z|.
"""

from __future__ import annotations

import statistics

from stapo.health.monitors import MIN_HISTORY, Window, register_monitor, robust_z


def _abs(z: float | None) -> float | None:
    return None if z is None else abs(z)


@register_monitor("entropy_collapse", reads=("entropy_mean",), threshold="ratio", fires="below")
def entropy_collapse(window: Window, ratio: float = 0.5) -> float | None:
    """Entropy falling fast: ``entropy_mean`` over the median of its window (half of it: a collapse)."""
    x, past = window.current("entropy_mean"), window.history("entropy_mean")
    if x is None or len(past) < MIN_HISTORY:
        return None
    baseline = statistics.median(past)
    return x / baseline if baseline > 0 else None


@register_monitor("entropy_blowup", reads=("entropy_mean",), threshold="z", fires="above")
def entropy_blowup(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Entropy exploding: robust z of ``entropy_mean``; the policy turning to noise."""
    return robust_z(window, "entropy_mean", rel_floor=floor)


@register_monitor("spurious_tokens", reads=("spurious_frac",), threshold="z", fires="above")
def spurious_tokens(window: Window, z: float = 6.0, abs_floor: float = 1e-4) -> float | None:
    """More tokens meeting STAPO's S2T criterion: robust z of ``spurious_frac`` (their share is the signal)."""
    return robust_z(window, "spurious_frac", abs_floor=abs_floor)


@register_monitor("ratio_tail", reads=("mismatch_logp_abs_max",), threshold="z", fires="above")
def ratio_tail(window: Window, z: float = 6.0, abs_floor: float = 0.5) -> float | None:
    """The importance ratios' tail: robust z of ``mismatch_logp_abs_max`` (sampler vs trainer, nats)."""
    return robust_z(window, "mismatch_logp_abs_max", abs_floor=abs_floor)


@register_monitor("is_ess", reads=("rollout_is_eff_sample_size",), threshold="level", fires="below")
def is_ess(window: Window, level: float = 0.5) -> float | None:
    """Importance weights concentrating: ``rollout_is_eff_sample_size`` (only with ``loss.rollout_is``)."""
    return window.current("rollout_is_eff_sample_size")


@register_monitor("mismatch_kl", reads=("mismatch_kl",), threshold="z", fires="above")
def mismatch_kl(window: Window, z: float = 6.0, abs_floor: float = 2e-4) -> float | None:
    """The rollout-trainer mismatch jumping: robust z of ``mismatch_kl`` (k3 KL(sampler || trainer))."""
    return robust_z(window, "mismatch_kl", abs_floor=abs_floor)


@register_monitor("grad_norm", reads=("grad_norm",), threshold="z", fires="above")
def grad_norm(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Gradient-norm spike: robust z of ``grad_norm`` (pre-clip, mean over the step's updates)."""
    return robust_z(window, "grad_norm", rel_floor=floor)


@register_monitor("update_kl", reads=("approx_kl",), threshold="z", fires="above")
def update_kl(window: Window, z: float = 6.0, abs_floor: float = 1e-3) -> float | None:
    """Updates growing: robust z of ``approx_kl`` (PPO's early-stop signal)."""
    return robust_z(window, "approx_kl", abs_floor=abs_floor)


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


@register_monitor("zero_std_groups", reads=("zero_std_group_frac",), threshold="z", fires="above")
def zero_std_groups(window: Window, z: float = 6.0, abs_floor: float = 0.05) -> float | None:
    """Groups with no learning signal piling up: robust z of ``zero_std_group_frac``."""
    return robust_z(window, "zero_std_group_frac", abs_floor=abs_floor)


@register_monitor("response_length", reads=("response_length_mean",), threshold="z", fires="above")
def response_length(window: Window, z: float = 6.0, floor: float = 0.05) -> float | None:
    """Responses collapsing or running away: |robust z| of ``response_length_mean``."""
    return _abs(robust_z(window, "response_length_mean", rel_floor=floor))


@register_monitor("truncation", reads=("response_clip_ratio",), threshold="z", fires="above")
def truncation(window: Window, z: float = 6.0, abs_floor: float = 0.02) -> float | None:
    """More responses cut at ``rollout.max_response_length``: robust z of ``response_clip_ratio``."""
    return robust_z(window, "response_clip_ratio", abs_floor=abs_floor)


@register_monitor("repetition", reads=("repetition_frac",), threshold="z", fires="above")
def repetition(window: Window, z: float = 6.0, abs_floor: float = 0.02) -> float | None:
    """Responses looping: robust z of ``repetition_frac`` (tokens closing a repeated 4-gram)."""
    return robust_z(window, "repetition_frac", abs_floor=abs_floor)


@register_monitor("tool_errors", reads=("tool_error_frac",), threshold="z", fires="above")
def tool_errors(window: Window, z: float = 6.0, abs_floor: float = 0.05) -> float | None:
    """Tool episodes: robust z of ``tool_error_frac`` (failed calls per call)."""
    return robust_z(window, "tool_error_frac", abs_floor=abs_floor)


@register_monitor("tool_calls", reads=("tool_calls_mean",), threshold="z", fires="above")
def tool_calls(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Tool episodes: calls per episode collapsing or running away: |robust z| of ``tool_calls_mean``."""
    return _abs(robust_z(window, "tool_calls_mean", rel_floor=floor))


@register_monitor("control_tokens", reads=("control_token_frac",), threshold="z", fires="above")
def control_tokens(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Tool episodes: the format's control tokens emitted more or less often: |robust z| of ``control_token_frac``."""
    return _abs(robust_z(window, "control_token_frac", rel_floor=floor))


@register_monitor("control_token_prob", reads=("control_token_prob",), threshold="z", fires="above")
def control_token_prob(window: Window, z: float = 6.0, abs_floor: float = 0.02) -> float | None:
    """Tool episodes: the probability of the emitted control tokens moving: |robust z| of ``control_token_prob``."""
    return _abs(robust_z(window, "control_token_prob", abs_floor=abs_floor))
