"""Token statistics for the monitors (repetition, a tool format's control tokens): pure tensor functions of
per-row counts or sums, so the step metrics add them over rows and ranks (split-invariant)."""

from __future__ import annotations

import torch

__all__ = ["REPEAT_NGRAM", "repeated_ngram_tokens", "control_token_sums"]

REPEAT_NGRAM = 4  # a token repeats when it closes a 4-gram already seen earlier in its response


def repeated_ngram_tokens(ids: torch.Tensor, mask: torch.Tensor, n: int = REPEAT_NGRAM) -> torch.Tensor:
    """Per row of ``ids`` (B, T): tokens closing an ``n``-gram (all in ``mask``) seen earlier in the row; exact
    (dense ids, no hashing)."""
    batch, length = ids.shape
    counts = torch.zeros(batch, dtype=torch.long, device=ids.device)
    if length < n:
        return counts
    valid = mask.unfold(1, n, 1).all(dim=-1)  # (B, T - n + 1): n-grams of policy tokens only
    grams = ids.unfold(1, n, 1)[valid].long()  # (N, n)
    rows = torch.arange(batch, device=ids.device)[:, None].expand_as(valid)[valid]
    pos = torch.arange(valid.shape[1], device=ids.device).expand_as(valid)[valid]
    if rows.numel() == 0:
        return counts
    vocab, key = int(grams.max()) + 1, rows
    for j in range(n):  # (dense id of (row, tokens < j)) * vocab + token j: below N * vocab, no overflow
        key = torch.unique(key, return_inverse=True)[1] * vocab + grams[:, j]
    key = torch.unique(key, return_inverse=True)[1]
    first = torch.full((int(key.max()) + 1,), valid.shape[1], dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, key, pos, reduce="amin")
    return counts.index_add_(0, rows, (pos > first[key]).long())


def control_token_sums(response_ids: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor,
                       control_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """How many ``mask``-ed tokens are ``control_ids`` (``<tool_call>``), and the sum of their probabilities."""
    hit = torch.isin(response_ids, control_ids.to(response_ids.device)) & mask
    return {"control_tokens": hit.sum(), "control_prob_sum": logprobs.detach().exp()[hit].sum()}
