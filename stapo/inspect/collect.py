"""Build a :class:`TokenRecord` from the trainer's mini-batch tensors (called every N steps).

Token texts are decoded once per distinct id; the top-k alternatives come from
:func:`stapo.losses.ops.token_topk`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from stapo.inspect.records import RecordRow, TokenRecord
from stapo.losses.reduce import masked_mean


def build_token_record(
    *, step: int, minibatch: int, mask_name: str, thresholds: dict[str, float],
    token_ids: torch.Tensor,       # (B, T) sampled response tokens
    logprobs: torch.Tensor,        # (B, T)
    entropy: torch.Tensor,         # (B, T)
    advantages: torch.Tensor,      # (B,) or (B, T)
    response_mask: torch.Tensor,   # (B, T) bool, valid response tokens
    keep: torch.Tensor,            # (B, T) bool, the active mask
    topk_ids: torch.Tensor,        # (B, T, K)
    topk_probs: torch.Tensor,      # (B, T, K)
    collision: torch.Tensor,       # (B, T)
    decode_token: Callable[[int], str],
    prompt_texts: Sequence[str], response_texts: Sequence[str],
    rewards: Sequence[float] | torch.Tensor,
    weights: torch.Tensor | None = None,  # (B, T) float, the mask's token weights (None: keep as 1 / 0)
    rejected: torch.Tensor | None = None,  # (B, T) bool, rejected by the off-policy correction (None: none)
    row_texts: Callable[[list[int]], list[str]] | None = None,
    context_segments: Sequence[list] | None = None,  # per row: [[position, text], ...] of an episode's tool turns
) -> TokenRecord:
    """Flatten the valid tokens (row-major) of one mini-batch into a record; rows are 0..B-1.

    ``row_texts`` (one row's valid token ids -> their texts, e.g. ``stapo.inspect.token_text.row_token_texts``)
    decodes response tokens with their neighbours; without it each is ``decode_token(id)``."""
    token_ids, logprobs, entropy, advantages, response_mask, keep, topk_ids, topk_probs, \
        collision = (x.detach().cpu() for x in (token_ids, logprobs, entropy, advantages,
                                                 response_mask, keep, topk_ids, topk_probs,
                                                 collision))
    b, t = token_ids.shape
    if not (len(prompt_texts) == len(response_texts) == len(rewards) == b):
        raise ValueError(f"need {b} prompt_texts/response_texts/rewards, got "
                         f"{len(prompt_texts)}/{len(response_texts)}/{len(rewards)}")
    valid = response_mask.bool()  # (B, T)
    adv_bt = advantages.float()
    if adv_bt.dim() == 1:
        adv_bt = adv_bt[:, None].expand(b, t)
    rows_idx, pos_idx = valid.nonzero(as_tuple=True)  # (N,), (N,)  row-major order
    flat_ids = token_ids[valid].long()  # (N,)
    flat_topk = topk_ids[valid].long()  # (N, K)
    cache = {i: decode_token(i) for i in set(flat_ids.tolist()) | set(flat_topk.flatten().tolist())}
    kept = (keep.bool() & valid)[valid]
    seq_adv = masked_mean(adv_bt, valid, dim=1)  # (B,)
    rows = [RecordRow(row=i, prompt_text=prompt_texts[i], response_text=response_texts[i],
                      reward=float(rewards[i]), advantage=float(seq_adv[i]),
                      context=list(context_segments[i]) if context_segments else []) for i in range(b)]
    return TokenRecord(
        step=step, minibatch=minibatch, mask_name=mask_name,
        thresholds={k: float(v) for k, v in thresholds.items()}, rows=rows,
        row=rows_idx.long(), position=pos_idx.long(), token_id=flat_ids,
        token_text=_token_texts(flat_ids, rows_idx, cache, row_texts),
        logprob=logprobs[valid].float(), entropy=entropy[valid].float(),
        advantage=adv_bt[valid].float(), kept=kept, silenced=~kept,
        topk_ids=flat_topk, topk_probs=topk_probs[valid].float(),
        topk_text=[[cache[i] for i in r] for r in flat_topk.tolist()],
        collision=collision[valid].float(),
        weight=None if weights is None else torch.where(kept, weights.detach().cpu()[valid].float(), 0.0),
        rejected=None if rejected is None else rejected.detach().cpu().bool()[valid],
    )


def _token_texts(ids: torch.Tensor, rows: torch.Tensor, cache: dict[int, str],
                 row_texts: Callable[[list[int]], list[str]] | None) -> list[str]:
    """Texts of the flattened (row-major) tokens: per id from ``cache``, or per row from ``row_texts``."""
    if row_texts is None:
        return [cache[i] for i in ids.tolist()]
    texts: list[str] = []
    for row in rows.unique_consecutive().tolist():
        texts += row_texts(ids[rows == row].tolist())
    return texts
