"""The no-grad stats pass and one policy update on one mini-batch (Algorithm 1 lines 7-12, Eq. 1),
independent of the micro-batch cut and the ranks (docs/algorithm.md, "Why the update is exact"): keep and
weights composed once on full rows, a GLOBAL loss normalizer, gradients summed over micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from stapo.losses import CorrectionResult, all_reduce_sum_, clipped_surrogate_loss
from stapo.losses.ops import DEFAULT_CHUNK_SIZE
from stapo.distributed.accumulation import GradientAccumulation
from stapo.trainer.microbatch import MicroBatches
from stapo.distributed.policy import response_token_stats
from stapo.distributed.zero3_trace import NO_GRAD, UPDATE, pass_kind


@dataclass(frozen=True)
class TrainBatch:
    """This rank's rows of one iteration, complete: everything the update reads."""

    prompt_ids: torch.Tensor  # (B, Lp) long, left-padded
    prompt_mask: torch.Tensor  # (B, Lp) bool
    response_ids: torch.Tensor  # (B, T) long, right-padded
    response_mask: torch.Tensor  # (B, T) bool
    advantages: torch.Tensor  # (B,) fp32, shared by all tokens of a response
    old_logprobs: torch.Tensor  # (B, T) fp32, policy at theta_old (trainer recompute)
    old_entropy: torch.Tensor  # (B, T) fp32
    sampling_logprobs: torch.Tensor | None = None  # (B, T) fp32, the rollout engine's (off-policy corrections)
    ref_logprobs: torch.Tensor | None = None  # (B, T) fp32, frozen reference policy (for the KL term)
    loss_mask: torch.Tensor | None = None  # (B, T) bool: tokens allowed in the loss (None: response_mask)
    context_mask: torch.Tensor | None = None  # (B, T) bool: episodes' context tokens, inputs only (None: none)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def rows(self, index: slice | torch.Tensor) -> "TrainBatch":
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return TrainBatch(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    @property
    def trainable(self) -> torch.Tensor:
        """(B, T) bool: response tokens the loss may use (``loss.mask_truncated`` drops cut rows)."""
        return self.response_mask if self.loss_mask is None else self.loss_mask & self.response_mask


@dataclass(frozen=True)
class UpdateOptions:
    """Flat loss/forward settings of an update (built once from the config)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    agg: str = "token-mean"
    log_ratio_clamp: float = 20.0
    temperature: float = 1.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_response_length: int | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    # micro-batching: rows (micro_batch_size) unless a token budget is set; packed or padded rows
    packing: bool = True
    pack_one_row: bool = False  # block-sparse attention (flash/flex): a micro-batch is one packed row
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    max_tokens_per_stats_micro_batch: int | None = None

    def budget(self, no_grad: bool) -> int | None:
        """Token budget of a micro-batch; the no-grad pass holds no activations, so it takes twice
        the update's budget unless set."""
        if no_grad and self.max_tokens_per_stats_micro_batch:
            return self.max_tokens_per_stats_micro_batch
        if self.max_tokens_per_micro_batch:
            return self.max_tokens_per_micro_batch * (2 if no_grad else 1)
        return None


@torch.no_grad()
def policy_stats(model, seqs, opts: UpdateOptions, trace: str = NO_GRAD) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad ``(logprobs, entropy)`` ``(B, T)`` fp32 on CPU of ``model`` over ``seqs``, zero on padding;
    ``trace``: the ZeRO-3 pass kind (stapo.distributed.zero3_trace)."""
    shape = seqs.response_ids.shape
    logprobs = torch.zeros(shape, dtype=torch.float32)
    entropy = torch.zeros(shape, dtype=torch.float32)
    with pass_kind(model, trace):
        for rows, inputs in MicroBatches(seqs, opts, _device(model), no_grad=True):
            lp, ent = response_token_stats(model, inputs, temperature=opts.temperature, chunk_size=opts.chunk_size)
            t_len = lp.shape[1]
            logprobs[rows, :t_len], entropy[rows, :t_len] = lp.cpu(), ent.cpu()
    return logprobs, entropy


def rollout_entropy(batch: TrainBatch) -> float:
    """Token-mean entropy of theta_old over the batch on all ranks (``TokenStats.batch_entropy``); NaN if empty."""
    valid = batch.response_mask
    sums = torch.stack([batch.old_entropy[valid].sum().double(), valid.sum().double()])
    total, count = all_reduce_sum_(sums).tolist()
    return total / count if count else float("nan")


def _global_normalizer(keep: torch.Tensor, trainable: torch.Tensor, agg: str) -> torch.Tensor:
    """Eq. 1's denominator over the mini-batch on all ranks: kept tokens (``token-mean``) or trainable rows."""
    local = keep.sum() if agg == "token-mean" else trainable.any(dim=1).sum()
    return all_reduce_sum_(local.to(torch.float64)).to(torch.float32)


def loss_tokens(trainable: torch.Tensor, keep: torch.Tensor, mask_weights: torch.Tensor | None,
                correction: CorrectionResult | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The mini-batch's ``(trainable, keep, weights)``, composed once (docs/losses.md, "Token weights"):
    trainable = trainable and not rejected; keep = mask keep, trainable, mask weight > 0; weights = mask
    weight x IS weight (None when neither is given). An IS weight of 0 (IcePop) keeps its token."""
    if correction is not None:
        trainable = trainable & ~correction.rejected
    keep = keep & trainable
    if mask_weights is not None:
        keep = keep & (mask_weights > 0)
    is_weights = None if correction is None else correction.weights
    if mask_weights is not None and is_weights is not None:
        return trainable, keep, mask_weights * is_weights
    return trainable, keep, mask_weights if is_weights is None else is_weights


def update_minibatch(engine, model, batch: TrainBatch, keep: torch.Tensor, opts: UpdateOptions,
                     weights: torch.Tensor | None = None,
                     correction: CorrectionResult | None = None) -> dict[str, torch.Tensor]:
    """Eq. 1 over the kept tokens, backward over micro-batches, one optimizer step; the mask's ``keep`` and
    ``weights`` and the off-policy ``correction`` are composed once (:func:`loss_tokens`). Returns this
    rank's metric SUMS as device tensors (the step reduces them once)."""
    with pass_kind(model, UPDATE):  # ZeRO-3: its own forward + backward trace (zero3_trace)
        trainable, keep, weights = loss_tokens(batch.trainable, keep, weights, correction)
        normalizer = _global_normalizer(keep, trainable, opts.agg)
        device = _device(model)
        micro_batches = MicroBatches(batch, opts, device, no_grad=False)
        accumulation = GradientAccumulation(engine, len(micro_batches))
        bonus = opts.entropy_coef != 0.0  # the entropy then needs its gradient
        sums: dict[str, torch.Tensor] = {}
        for rows, inputs in micro_batches:
            logprobs, entropy = response_token_stats(model, inputs, temperature=opts.temperature,
                                                     chunk_size=opts.chunk_size, entropy_grad=bonus,
                                                     runner=engine)
            t_len = logprobs.shape[1]
            part = batch.rows(rows)
            old = part.old_logprobs[:, :t_len].to(device)
            micro_keep = keep[rows, :t_len].to(device)
            micro_weights = weights[rows, :t_len].to(device) if weights is not None else None
            ref = part.ref_logprobs[:, :t_len].to(device) if part.ref_logprobs is not None else None
            loss, metrics = clipped_surrogate_loss(
                logprobs, old, part.advantages.to(device), micro_keep,
                clip_low=opts.clip_low, clip_high=opts.clip_high, clip_c=opts.clip_c, agg=opts.agg,
                normalizer=normalizer.to(device), max_response_length=opts.max_response_length,
                log_ratio_clamp=opts.log_ratio_clamp, ref_logprobs=ref, kl_coef=opts.kl_coef,
                entropy=entropy if bonus else None, entropy_coef=opts.entropy_coef, weights=micro_weights,
            )
            accumulation.backward(loss)
            _accumulate(sums, {"loss": loss.detach(), **metrics})
        step = accumulation.step()
        _accumulate(sums, {
            "step_applied": torch.tensor(float(step.applied)),
            "grad_norm": torch.tensor(float(step.grad_norm) if step.applied else 0.0),
            "micro_batches": torch.tensor(float(len(micro_batches))),
        })
    return sums


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _accumulate(total: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    for key, value in new.items():
        value = value.detach().float()
        total[key] = total[key] + value if key in total else value
