"""stapo.losses: advantages, token stats, token masks, off-policy corrections and the clipped surrogate.

May import: torch and ``stapo.registry``/``stapo.run_dir`` only (docs/index.md, "Layout"): pure tensor functions.
"""

from stapo.losses.advantages import group_advantages
from stapo.losses.ops import TokenTopK, logprobs_and_entropy_from_logits, token_logprobs_and_entropy, token_topk
from stapo.losses.reduce import all_reduce_sum_, masked_mean, masked_quantile, masked_sum
from stapo.losses.masks import (
    MASKS,
    MaskResult,
    TokenMask,
    TokenStats,
    available_masks,
    build_mask,
    describe_masks,
    mask_params,
    register_mask,
    registered_name,
)
from stapo.losses import builtin_masks  # noqa: E402,F401  (registers the built-in masks)
from stapo.losses.builtin_masks import (
    EntropyTopMask,
    HighEntropyLowProbMask,
    NoMask,
    ProbOnlyMask,
    STAPOMask,
    spurious_probe,
)
from stapo.losses import weighting_masks  # noqa: E402,F401  (registers stare and clip_cov)
from stapo.losses.weighting_masks import ClipCovMask, STAREMask
from stapo.losses.mismatch import mismatch_sums
from stapo.losses.corrections import (IS_LEVELS, RS_OPTIONS, CorrectionResult, RejectionBound, RolloutCorrection,
                                      importance_weights, normalize_weights, rejected_tokens, rs_statistic)
from stapo.losses.surrogate import AGG_MODES, aggregate_loss, clipped_surrogate_loss
from stapo.losses.truncation import truncated_keep, truncated_rows

__all__ = [
    # advantages (Eq. 2)
    "group_advantages",
    # token stats and reductions
    "token_logprobs_and_entropy",
    "logprobs_and_entropy_from_logits",
    "token_topk",
    "TokenTopK",
    "masked_sum",
    "masked_mean",
    "masked_quantile",
    "all_reduce_sum_",
    # masks (Algorithm 1 lines 7-10)
    "TokenStats",
    "TokenMask",
    "MaskResult",
    "MASKS",
    "register_mask",
    "registered_name",
    "build_mask",
    "available_masks",
    "mask_params",
    "describe_masks",
    "NoMask",
    "STAPOMask",
    "ProbOnlyMask",
    "HighEntropyLowProbMask",
    "EntropyTopMask",
    "spurious_probe",
    "STAREMask",
    "ClipCovMask",
    # surrogate (Eq. 1)
    "clipped_surrogate_loss",
    "aggregate_loss",
    "AGG_MODES",
    # rollout-trainer mismatch
    "mismatch_sums",
    # off-policy corrections (verl's rollout correction: IS weights, IcePop, rejection)
    "RolloutCorrection",
    "CorrectionResult",
    "RejectionBound",
    "IS_LEVELS",
    "RS_OPTIONS",
    "importance_weights",
    "normalize_weights",
    "rejected_tokens",
    "rs_statistic",
    # overlong filtering (DAPO §3.4)
    "truncated_keep",
    "truncated_rows",
]
