"""Masked reductions and their distributed versions (docs/losses.md, "Reductions").

Empty masks give 0 for sums and means, ``+inf`` for quantiles, never NaN, so an all-silenced micro-batch
or an empty rank cannot poison a step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["masked_sum", "masked_mean", "masked_quantile", "all_reduce_sum_", "world_size", "distributed_on",
           "rank", "all_gather_variable", "check_like_logprobs"]


def check_like_logprobs(shape: torch.Size, prefix: str = "", **tensors) -> None:
    """Each of ``tensors`` that is not None has the logprobs' ``(B, T)`` ``shape``; else a ValueError naming it."""
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{prefix}{name} shape {tuple(t.shape)} != logprobs shape {tuple(shape)}")


def distributed_on() -> bool:
    """THE check that a process group exists (the trainer's and the rollout's helpers use it too)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    """Number of ranks in ``group`` (1 when torch.distributed is not initialized)."""
    return dist.get_world_size(group) if distributed_on() else 1


def rank(group=None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialized)."""
    return dist.get_rank(group) if world_size(group) > 1 else 0


def all_gather_variable(values: torch.Tensor, group=None) -> torch.Tensor:
    """1-D ``values`` of every rank of ``group`` concatenated in rank order (lengths may differ, may be 0)."""
    n = world_size(group)
    if n == 1:
        return values
    local_len = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    lengths = [torch.zeros_like(local_len) for _ in range(n)]
    dist.all_gather(lengths, local_len, group=group)
    sizes = [int(s.item()) for s in lengths]
    longest = max(sizes)
    if longest == 0:
        return values[:0]
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    shards = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(shards, padded, group=group)
    return torch.cat([shard[:size] for shard, size in zip(shards, sizes)])


def all_reduce_sum_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group`` in place (no-op with one rank); returns it."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is true; ``torch.where``, not ``x * mask``: inf/NaN outside it leak neither
    into the value nor into the gradient."""
    picked = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over true entries of ``mask``; 0 (not NaN) where nothing is selected."""
    count = mask.expand_as(x).sum() if dim is None else mask.expand_as(x).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_quantile(
    values: torch.Tensor, mask: torch.Tensor, q: float, group=None
) -> torch.Tensor:
    """Exact ``q``-quantile of ``values[mask]`` over ALL ranks (0-dim, no grad; ``+inf`` without a value).

    Global, so ``tau_h`` does not depend on the split (docs/algorithm.md, "Why the update is exact").
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    dtype = values.dtype if values.dtype in (torch.float32, torch.float64) else torch.float32
    flat = all_gather_variable(values.detach()[mask].to(dtype), group)  # (n_valid,) of all ranks
    n = flat.numel()
    if n == 0:
        return torch.tensor(float("inf"), dtype=dtype, device=values.device)
    ordered = flat.sort().values
    rank = torch.tensor(q, dtype=dtype) * (n - 1)  # same dtype arithmetic as torch.quantile
    lo = int(torch.floor(rank).item())
    hi = min(lo + 1, n - 1)
    weight = (rank - lo).to(values.device)
    return torch.lerp(ordered[lo], ordered[hi], weight)
