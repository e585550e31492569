"""The built-in monitors (docs/health.md has the table: statistic, threshold, what it watches for).

Each returns one statistic from the window of step metrics (stapo.health.monitors). Robust z-scores
use a floor on their scale (``floor`` relative to the baseline's median, ``abs_floor`` absolute) so
that a nearly constant metric does not turn a small wobble into a spike; two-sided ones return |z|.
Defaults were set from two pilot runs (seed 9, not in the study, docs/health.md "Settings").
"""

from __future__ import annotations

import statistics

from stapo.health.monitors import MIN_HISTORY, Window, register_monitor, robust_z


def _abs(z: float | None) -> float | None:
    return None if z is None else abs(z)


@register_monitor("entropy_collapse", reads=("entropy_mean",), threshold="ratio", fires="below")
def entropy_collapse(window: Window, ratio: float = 0.5) -> float | None:
    """Entropy falling fast: ``entropy_mean`` over the median of its window. RL lowers entropy slowly
    as a policy sharpens; half the recent level within one window is a collapse (the policy stops
    exploring: every sample of a group alike, zero advantages, a frozen mistake)."""
    x, past = window.current("entropy_mean"), window.history("entropy_mean")
    if x is None or len(past) < MIN_HISTORY:
        return None
    baseline = statistics.median(past)
    return x / baseline if baseline > 0 else None


@register_monitor("entropy_blowup", reads=("entropy_mean",), threshold="z", fires="above")
def entropy_blowup(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Entropy exploding: robust z of ``entropy_mean`` (scale at least ``floor`` x the median), above ``z``:
    the policy turning to noise, typically after a few large updates."""
    return robust_z(window, "entropy_mean", rel_floor=floor)


@register_monitor("spurious_tokens", reads=("spurious_frac",), threshold="z", fires="above")
def spurious_tokens(window: Window, z: float = 6.0, abs_floor: float = 1e-4) -> float | None:
    """More spurious tokens (STAPO's S2T criterion ``A > 0, p < tau_p, H < tau_h``, measured whatever
    the mask): robust z of ``spurious_frac``, scale at least ``abs_floor`` (0.01% of tokens, the
    paper's typical share, so single tokens in a quiet run do not count). Their probability is below
    ``tau_p`` by definition, so their share is the signal, not their probability."""
    return robust_z(window, "spurious_frac", abs_floor=abs_floor)


@register_monitor("ratio_tail", reads=("mismatch_logp_abs_max",), threshold="z", fires="above")
def ratio_tail(window: Window, z: float = 6.0, abs_floor: float = 0.5) -> float | None:
    """The importance ratios' tail: robust z of ``mismatch_logp_abs_max`` (the largest |log pi_sampler -
    log pi_old| of the step), scale at least ``abs_floor`` nats: one token whose probability the
    rollout engine and the trainer disagree on by a new order of magnitude."""
    return robust_z(window, "mismatch_logp_abs_max", abs_floor=abs_floor)


@register_monitor("is_ess", reads=("rollout_is_eff_sample_size",), threshold="level", fires="below")
def is_ess(window: Window, level: float = 0.5) -> float | None:
    """Importance weights concentrating: ``rollout_is_eff_sample_size`` ((sum w)^2 / (n sum w^2), 1 when
    all weights are equal) below ``level``. Only with ``loss.rollout_is``."""
    return window.current("rollout_is_eff_sample_size")


@register_monitor("mismatch_kl", reads=("mismatch_kl",), threshold="z", fires="above")
def mismatch_kl(window: Window, z: float = 6.0, abs_floor: float = 2e-4) -> float | None:
    """The rollout-trainer mismatch jumping: robust z of ``mismatch_kl`` (k3 KL(sampler || trainer)),
    scale at least ``abs_floor`` nats, so an fp32 HF engine's ~1e-10 never counts."""
    return robust_z(window, "mismatch_kl", abs_floor=abs_floor)


@register_monitor("grad_norm", reads=("grad_norm",), threshold="z", fires="above")
def grad_norm(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Gradient-norm spike: robust z of ``grad_norm`` (the pre-clip norm, mean over the step's updates),
    scale at least ``floor`` x the median."""
    return robust_z(window, "grad_norm", rel_floor=floor)


@register_monitor("update_kl", reads=("approx_kl",), threshold="z", fires="above")
def update_kl(window: Window, z: float = 6.0, abs_floor: float = 1e-3) -> float | None:
    """Updates growing: robust z of ``approx_kl`` (how far the step's updates moved the policy from
    theta_old on its kept tokens), scale at least ``abs_floor`` nats; PPO's early-stop signal."""
    return robust_z(window, "approx_kl", abs_floor=abs_floor)


@register_monitor("reward_drop", reads=("accuracy",), threshold="drop", fires="above")
def reward_drop(window: Window, drop: float = 0.1, span: int = 10) -> float | None:
    """Training accuracy falling: the best mean of ``accuracy`` over ``span`` consecutive steps of the
    window minus the mean of the last ``span`` steps, above ``drop`` (0.1: ten points). The sampled
    rollouts' accuracy, every step, where held-out accuracy comes every ``trainer.eval_every`` steps."""
    x = window.current("accuracy")
    values = [*window.history("accuracy"), x]
    if x is None or len(values) < 2 * span:
        return None
    means = [statistics.fmean(values[i:i + span]) for i in range(len(values) - span + 1)]
    return max(means) - means[-1]


@register_monitor("clip_frac", reads=("clip_frac_low", "clip_frac_high"), threshold="z", fires="above")
def clip_frac(window: Window, z: float = 6.0, abs_floor: float = 0.005) -> float | None:
    """Updates leaving the trust region: robust z of ``clip_frac_low`` + ``clip_frac_high``, scale at least
    ``abs_floor`` (half a percent of the kept tokens)."""
    both = [{"clip": r["clip_frac_low"] + r["clip_frac_high"]} if "clip_frac_low" in r and "clip_frac_high" in r
            else {} for r in window.rows]
    return robust_z(Window(both), "clip", abs_floor=abs_floor)


@register_monitor("zero_std_groups", reads=("zero_std_group_frac",), threshold="z", fires="above")
def zero_std_groups(window: Window, z: float = 6.0, abs_floor: float = 0.05) -> float | None:
    """Groups with no learning signal piling up (every sample scored alike, A = 0): robust z of
    ``zero_std_group_frac``, scale at least ``abs_floor``."""
    return robust_z(window, "zero_std_group_frac", abs_floor=abs_floor)


@register_monitor("response_length", reads=("response_length_mean",), threshold="z", fires="above")
def response_length(window: Window, z: float = 6.0, floor: float = 0.05) -> float | None:
    """Responses collapsing or running away: |robust z| of ``response_length_mean``, scale at least
    ``floor`` x the median."""
    return _abs(robust_z(window, "response_length_mean", rel_floor=floor))


@register_monitor("truncation", reads=("response_clip_ratio",), threshold="z", fires="above")
def truncation(window: Window, z: float = 6.0, abs_floor: float = 0.02) -> float | None:
    """More responses cut at ``rollout.max_response_length`` (runaway generations): robust z of
    ``response_clip_ratio``, scale at least ``abs_floor``."""
    return robust_z(window, "response_clip_ratio", abs_floor=abs_floor)


@register_monitor("repetition", reads=("repetition_frac",), threshold="z", fires="above")
def repetition(window: Window, z: float = 6.0, abs_floor: float = 0.02) -> float | None:
    """Responses looping: robust z of ``repetition_frac`` (response tokens that close a 4-gram already seen
    in the same response), scale at least ``abs_floor``."""
    return robust_z(window, "repetition_frac", abs_floor=abs_floor)


@register_monitor("tool_errors", reads=("tool_error_frac",), threshold="z", fires="above")
def tool_errors(window: Window, z: float = 6.0, abs_floor: float = 0.05) -> float | None:
    """Tool episodes: failed calls per call (``tool_error_frac``; a call that does not parse is one)
    rising: robust z, scale at least ``abs_floor``."""
    return robust_z(window, "tool_error_frac", abs_floor=abs_floor)


@register_monitor("tool_calls", reads=("tool_calls_mean",), threshold="z", fires="above")
def tool_calls(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Tool episodes: calls per episode collapsing or running away: |robust z| of ``tool_calls_mean``,
    scale at least ``floor`` x the median."""
    return _abs(robust_z(window, "tool_calls_mean", rel_floor=floor))


@register_monitor("control_tokens", reads=("control_token_frac",), threshold="z", fires="above")
def control_tokens(window: Window, z: float = 6.0, floor: float = 0.1) -> float | None:
    """Tool episodes: the format's control tokens (``<tool_call>``, ``</tool_call>``) emitted more or less
    often: |robust z| of ``control_token_frac``, scale at least ``floor`` x the median."""
    return _abs(robust_z(window, "control_token_frac", rel_floor=floor))


@register_monitor("control_token_prob", reads=("control_token_prob",), threshold="z", fires="above")
def control_token_prob(window: Window, z: float = 6.0, abs_floor: float = 0.02) -> float | None:
    """Tool episodes: the probability the policy gave the control tokens it emitted moving: |robust z|
    of ``control_token_prob``, scale at least ``abs_floor``. A format the policy was sure of turning
    uncertain (or a tag it used to doubt turning certain) breaks episodes before it shows in reward."""
    return _abs(robust_z(window, "control_token_prob", abs_floor=abs_floor))
