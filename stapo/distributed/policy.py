"""Teacher-forced token statistics of the policy over rollout responses (Algorithm 1 line 8; docs/losses.md).

The whole pass runs as the root module's forward so ZeRO-3 prefetches (docs/distributed.md, "ZeRO-3 prefetch").
Context tokens of multi-turn episodes (docs/tir.md) are inputs, never targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from stapo.distributed.attention import packed_attention_kwargs
from stapo.losses import token_logprobs_and_entropy, token_topk


@dataclass
class PolicyInputs:
    """Padded teacher-forced inputs for ``b`` rows: ``[left-padded prompt | right-padded response]``."""

    input_ids: torch.Tensor  # (b, Lp + T) long
    attention_mask: torch.Tensor  # (b, Lp + T) long
    position_ids: torch.Tensor  # (b, Lp + T) long
    response_ids: torch.Tensor  # (b, T) long
    response_mask: torch.Tensor  # (b, T) bool
    prompt_length: int  # Lp: hidden state at Lp - 1 + t predicts response token t

    @classmethod
    def from_parts(cls, prompt_ids, prompt_mask, response_ids, response_mask, context_mask=None) -> "PolicyInputs":
        """Concatenate and trim all-padding columns (left of prompts, right of responses); context
        tokens (``context_mask``) are attended to, never predicted."""
        prompt_cols = prompt_mask.any(dim=0).nonzero()
        first = int(prompt_cols[0]) if len(prompt_cols) else prompt_mask.shape[1] - 1
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
        response_ids, response_mask, real = _trim_responses(response_ids, response_mask, context_mask)
        attention = torch.cat([prompt_mask, real], dim=1).long()  # (b, Lp + T)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)  # left padding: real tokens start at 0
        return cls(
            input_ids=torch.cat([prompt_ids, response_ids], dim=1),
            attention_mask=attention,
            position_ids=positions,
            response_ids=response_ids,
            response_mask=response_mask.bool(),
            prompt_length=prompt_ids.shape[1],
        )

    def to(self, device) -> "PolicyInputs":
        return PolicyInputs(
            self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
            self.response_ids.to(device), self.response_mask.to(device), self.prompt_length,
        )

    def target_hidden(self, decoder) -> torch.Tensor:
        """Hidden states that predict the valid response tokens, ``(N, H)`` in row-major order."""
        out = decoder(input_ids=self.input_ids, attention_mask=self.attention_mask,
                      position_ids=self.position_ids, use_cache=False)
        start, t_len = self.prompt_length - 1, self.response_ids.shape[1]
        return out.last_hidden_state[:, start: start + t_len][self.response_mask]


@dataclass
class PackedInputs:
    """Padding-free teacher-forced inputs: ``b`` sequences concatenated in rows, position ids restarting at 0.

    ``row_width=None``: ONE row (flash/flex, whose cost follows the sequences); a width: first-fit-decreasing
    rows (sdpa's dense mask then costs no more than padding).
    """

    input_ids: torch.Tensor  # (R, S) long
    position_ids: torch.Tensor  # (R, S) long, 0.. per sequence
    target_index: torch.Tensor  # (N,) long: flat (R * S) index whose hidden state predicts valid token n
    response_ids: torch.Tensor  # (b, T) long
    response_mask: torch.Tensor  # (b, T) bool

    @classmethod
    def from_parts(cls, prompt_ids, prompt_mask, response_ids, response_mask, context_mask=None,
                   row_width: int | None = None) -> "PackedInputs":
        """Pack left-padded prompts and right-padded responses (real tokens of a row, context tokens
        included, are contiguous); targets are the ``response_mask`` tokens only."""
        if not bool(prompt_mask.any(dim=1).all()):
            raise ValueError("PackedInputs: every row needs at least one prompt token")
        response_ids, response_mask, response_real = _trim_responses(response_ids, response_mask, context_mask)
        real = torch.cat([prompt_mask, response_real], dim=1)  # (b, Lp + T) bool
        tokens = torch.cat([prompt_ids, response_ids], dim=1)
        lengths = real.sum(dim=1).tolist()
        width = max(lengths) if row_width is None else max(row_width, max(lengths))
        rows = [list(range(len(lengths)))] if row_width is None else _first_fit_decreasing(lengths, width)
        width = max(sum(lengths[i] for i in r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        starts = [0] * len(lengths)  # flat index of each sequence's first token
        for r, members in enumerate(rows):
            col = 0
            for i in members:
                ids[r, col: col + lengths[i]] = tokens[i][real[i]]
                positions[r, col: col + lengths[i]] = torch.arange(lengths[i])
                starts[i], col = r * width + col, col + lengths[i]
            positions[r, col:] = torch.arange(width - col)  # tail: its own dummy sequence
        prompt_lengths = prompt_mask.sum(dim=1)
        first = torch.tensor(starts) + prompt_lengths - 1  # (b,) predicts response token 0
        steps = torch.arange(response_mask.shape[1])
        target = (first[:, None] + steps[None, :])[response_mask]  # (N,) row-major over (b, T)
        return cls(ids, positions, target, response_ids, response_mask.bool())

    def to(self, device) -> "PackedInputs":
        return PackedInputs(self.input_ids.to(device), self.position_ids.to(device), self.target_index.to(device),
                            self.response_ids.to(device), self.response_mask.to(device))

    def target_hidden(self, decoder) -> torch.Tensor:
        """As :meth:`PolicyInputs.target_hidden`; the attention arguments are built once per micro-batch."""
        attention = packed_attention_kwargs(decoder.config._attn_implementation, self.position_ids)
        out = decoder(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False, **attention)
        return out.last_hidden_state.flatten(0, 1)[self.target_index]  # (N, H)


def _first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Sequences into rows of at most ``width`` tokens, longest first, each into the first row with room."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if r is None:
            rows.append([])
            free.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


TeacherForcedInputs = Union[PolicyInputs, PackedInputs]


def teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, *, packed: bool,
                          one_row: bool = False, context_mask=None) -> TeacherForcedInputs:
    """THE builder of teacher-forced inputs: padded, or packed into rows as wide as the longest sequence
    (``one_row``: a single row, for block-sparse attention kernels)."""
    if not packed:
        return PolicyInputs.from_parts(prompt_ids, prompt_mask, response_ids, response_mask, context_mask)
    real = response_mask if context_mask is None else response_mask | context_mask
    width = None if one_row else int((prompt_mask.sum(dim=1) + real.sum(dim=1)).max())
    return PackedInputs.from_parts(prompt_ids, prompt_mask, response_ids, response_mask, context_mask,
                                   row_width=width)


def _trim_responses(response_ids, response_mask, context_mask=None):
    """``(ids, response_mask, real)`` without the response columns that are padding in every row
    (keep at least one); ``real`` = response and context tokens."""
    real = response_mask if context_mask is None else response_mask | context_mask
    cols = real.any(dim=0).nonzero()
    t_len = int(cols[-1]) + 1 if len(cols) else 1
    return response_ids[:, :t_len], response_mask[:, :t_len], real[:, :t_len]


def _run_as_forward(module: torch.nn.Module, fn, *args, caller=None):
    """Call ``fn(*args)`` as ``module``'s forward, so its hooks (ZeRO-3's gathers) run around it;
    ``caller``: what calls ``module`` (e.g. the DeepSpeed engine wrapping it)."""
    module.forward = fn
    try:
        return (caller or module)(*args)
    finally:
        del module.forward  # back to the class's own forward


def head_on_targets(model, inputs: TeacherForcedInputs, fn, runner=None):
    """``fn(hidden, head_weight)`` on the ``(N, H)`` hidden states that predict valid response tokens, in one
    call of the root module; ``runner``: the DeepSpeed engine for a pass that is backpropagated (its forward
    registers the backward hooks its optimizer relies on)."""
    head = model.get_output_embeddings()

    def forward():
        hidden = inputs.target_hidden(model.get_decoder())  # (N, H): valid tokens only
        return _run_as_forward(head, lambda h: fn(h, head.weight), hidden)

    return _run_as_forward(model, forward, caller=runner)


def response_token_stats(model, inputs: TeacherForcedInputs, *, temperature: float, chunk_size: int,
                         entropy_grad: bool = False, runner=None):
    """``(logprobs, entropy)`` of each response token, ``(b, T)`` fp32, zero on padding; ``entropy`` carries
    a gradient only with ``entropy_grad`` (the entropy bonus)."""
    mask = inputs.response_mask
    labels = inputs.response_ids[mask]  # (N,)

    def stats(h, weight):
        return token_logprobs_and_entropy(h, weight, labels, temperature=temperature, chunk_size=chunk_size,
                                          entropy_grad=entropy_grad)

    logprobs_flat, entropy_flat = head_on_targets(model, inputs, stats, runner)
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    entropy_flat = entropy_flat if entropy_grad else entropy_flat.detach()
    return zeros.masked_scatter(mask, logprobs_flat), zeros.masked_scatter(mask, entropy_flat)


@torch.no_grad()
def response_token_topk(model, inputs: TeacherForcedInputs, *, temperature: float, chunk_size: int, k: int = 5):
    """Top-``k`` alternatives and collision probability of each valid response token (inspector)."""
    return head_on_targets(
        model, inputs, lambda h, w: token_topk(h, w, k=k, temperature=temperature, chunk_size=chunk_size))
