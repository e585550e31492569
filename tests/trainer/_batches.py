"""Test helper: ragged rows like a rollout's (left-padded prompts, right-padded responses)."""

from __future__ import annotations

import torch


def ragged_rows(prompt_lens, resp_lens, seed=0, vocab=(5, 300)):
    """``(prompt_ids, prompt_mask, response_ids, response_mask)`` with random ids of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    b, lp, lt = len(prompt_lens), max(prompt_lens), max(resp_lens)
    prompt_ids = torch.zeros(b, lp, dtype=torch.long)
    prompt_mask = torch.zeros(b, lp, dtype=torch.bool)
    response_ids = torch.zeros(b, lt, dtype=torch.long)
    response_mask = torch.zeros(b, lt, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        prompt_ids[i, lp - p:] = torch.randint(*vocab, (p,), generator=g)
        prompt_mask[i, lp - p:] = True
        response_ids[i, :r] = torch.randint(*vocab, (r,), generator=g)
        response_mask[i, :r] = True
    return prompt_ids, prompt_mask, response_ids, response_mask
