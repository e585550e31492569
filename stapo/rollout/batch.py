"""`Rollout`: the typed batch that every driver returns and the trainer consumes (docs/rollout.md, "`Rollout`").

Row i answers prompt i // G (the group advantages of paper §2.1 rely on it); prompts LEFT-, responses RIGHT-padded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["EpisodeInfo", "Rollout", "left_pad", "right_pad", "row_lengths"]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> `(ids (N, L) long, mask (N, L) bool)`, padded on the left to the longest."""
    ids = right_pad([list(r)[::-1] for r in rows], pad_id, torch.long).flip(1)
    return ids, right_pad([[True] * len(r) for r in rows], False, torch.bool).flip(1)


def right_pad(rows: Sequence[Sequence[float | bool]], pad: float | bool, dtype: torch.dtype) -> torch.Tensor:
    """Lists -> `(N, L)` tensor of `dtype`, padded on the right with `pad` to the longest."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=dtype)
    return out


def _pad_columns(x: torch.Tensor, width: int, value: float | bool, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value)


@dataclass(frozen=True)
class EpisodeInfo:
    """What each row's multi-turn episode did besides its tokens (docs/tir.md); B entries each."""

    turns: torch.Tensor  # (B,) long: policy turns
    tool_calls: torch.Tensor  # (B,) long: tool calls parsed from its turns (each ran, or failed to parse)
    tool_errors: torch.Tensor  # (B,) long: calls that ended in a tool error (bad call, failure, a limit)
    tool_seconds: torch.Tensor  # (B,) float64: seconds its tool calls ran (summed over calls)
    final_text: list[str]  # its last policy turn: the text the verifier scores
    tool_wait_s: float = 0.0  # wall seconds the episode loop waited for tools (all rows together)

    def __post_init__(self) -> None:
        b = len(self.final_text)
        for name in ("turns", "tool_calls", "tool_errors", "tool_seconds"):
            if tuple(getattr(self, name).shape) != (b,):
                raise ValueError(f"EpisodeInfo.{name} has shape {tuple(getattr(self, name).shape)}, expected ({b},)")

    def select(self, idx: torch.Tensor) -> EpisodeInfo:
        picked = idx.tolist()
        return EpisodeInfo(self.turns[idx], self.tool_calls[idx], self.tool_errors[idx], self.tool_seconds[idx],
                           [self.final_text[i] for i in picked], self.tool_wait_s)

    @classmethod
    def concat(cls, parts: Sequence[EpisodeInfo]) -> EpisodeInfo:
        return cls(*(torch.cat([getattr(p, name) for p in parts])
                     for name in ("turns", "tool_calls", "tool_errors", "tool_seconds")),
                   [t for p in parts for t in p.final_text], sum(p.tool_wait_s for p in parts))


@dataclass
class Rollout:
    """Sampled responses for P prompts × G samples (B = P·G rows, row i: prompt i // G, sample i % G); each
    field's meaning in full: the table in docs/rollout.md, "`Rollout`"."""

    prompt_ids: torch.Tensor  # (B, Lp) long, LEFT-padded with pad_token_id
    prompt_mask: torch.Tensor  # (B, Lp) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long, RIGHT-padded with pad_token_id
    response_mask: torch.Tensor  # (B, T) bool: the sampled tokens, the EOS / stop token that ended a row too
    sampling_logprobs: torch.Tensor  # (B, T) float32 under the processed sampling distribution; 0 elsewhere
    finish_reason: list[str]  # "stop", "length" or "error" (a rollout server refused the request: no tokens)
    response_text: list[str]  # decoded, special tokens skipped
    group_index: torch.Tensor  # (B,) long: equal values answer one prompt (`concat` offsets later parts)
    group_size: int  # G, samples per prompt
    ground_truth: list[str] = field(default_factory=list)  # B answers or empty (`with_ground_truth`)
    prompt_text: list[str] = field(default_factory=list)  # B prompts or empty (`with_prompt_text`)
    pad_token_id: int = 0  # what `concat` re-pads with
    policy_version: torch.Tensor | None = None  # (B,) long: the version that sampled a row (its oldest token's)
    token_version: torch.Tensor | None = None  # (B, T) long, 0 off response_mask; None: filled from policy_version
    context_mask: torch.Tensor | None = None  # (B, T) bool: an episode's context tokens; None: none (all False)
    episodes: EpisodeInfo | None = None  # per row: turns, tool calls and errors, the final turn's text

    def __post_init__(self) -> None:
        if self.context_mask is None:
            self.context_mask = torch.zeros_like(self.response_mask, dtype=torch.bool)
        b = self.prompt_ids.shape[0]
        checks = {
            "prompt_mask": (self.prompt_mask.shape, self.prompt_ids.shape),
            "response_mask": (self.response_mask.shape, self.response_ids.shape),
            "sampling_logprobs": (self.sampling_logprobs.shape, self.response_ids.shape),
            "context_mask": (self.context_mask.shape, self.response_ids.shape),
            "group_index": (self.group_index.shape, torch.Size([b])),
        }
        if self.policy_version is not None:
            checks["policy_version"] = (self.policy_version.shape, torch.Size([b]))
        if self.token_version is not None:
            checks["token_version"] = (self.token_version.shape, self.response_ids.shape)
        for name, (got, want) in checks.items():
            if got != want:
                raise ValueError(f"Rollout.{name} has shape {tuple(got)}, expected {tuple(want)}")
        if self.response_ids.shape[0] != b:
            raise ValueError(f"Rollout.response_ids has {self.response_ids.shape[0]} rows, prompt_ids has {b}")
        if any(m.dtype != torch.bool for m in (self.prompt_mask, self.response_mask, self.context_mask)):
            raise ValueError("Rollout.prompt_mask, response_mask and context_mask must be bool tensors")
        if bool((self.response_mask & self.context_mask).any()):
            raise ValueError("Rollout.context_mask is True on tokens response_mask marks as sampled")
        if self.episodes is not None and len(self.episodes.final_text) != b:
            raise ValueError(f"Rollout.episodes has {len(self.episodes.final_text)} rows, expected {b}")
        if self.group_size < 1:
            raise ValueError(f"Rollout.group_size must be >= 1, got {self.group_size}")
        for name in ("finish_reason", "response_text"):
            if len(getattr(self, name)) != b:
                raise ValueError(f"Rollout.{name} has {len(getattr(self, name))} entries, expected {b}")
        for name in ("ground_truth", "prompt_text"):
            if len(getattr(self, name)) not in (0, b):
                raise ValueError(f"Rollout.{name} has {len(getattr(self, name))} entries, expected 0 or {b}")
        if self.token_version is None and self.policy_version is not None:  # every token: its row's version
            self.token_version = torch.where(self.response_mask, self.policy_version[:, None],
                                             torch.zeros((), dtype=torch.long))

    # ----------------------------------------------------------------- sizes
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        """P = B // G (for a `select`-ed subset: the number of whole groups it spans)."""
        return len(self) // self.group_size

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) long, number of generated tokens per row (EOS included; context tokens not)."""
        return self.response_mask.sum(dim=1)

    @property
    def real_mask(self) -> torch.Tensor:
        """(B, T) bool: every real token of the response part, the policy's and context."""
        return self.response_mask | self.context_mask

    @property
    def answer_text(self) -> list[str]:
        """What the verifier scores: an episode's last policy turn, else the whole response."""
        return self.episodes.final_text if self.episodes is not None else self.response_text

    # ----------------------------------------------------------- annotation
    def with_ground_truth(self, answers_per_prompt: Sequence[str]) -> Rollout:
        """Copy with `ground_truth` set: one answer per prompt, repeated for its G rows."""
        return dataclasses.replace(self, ground_truth=self._per_row(answers_per_prompt, "answers_per_prompt"))

    def with_prompt_text(self, texts_per_prompt: Sequence[str]) -> Rollout:
        """Copy with `prompt_text` set: one text per prompt, repeated for its G rows."""
        return dataclasses.replace(self, prompt_text=self._per_row(texts_per_prompt, "texts_per_prompt"))

    def with_policy_version(self, version: int) -> Rollout:
        """Copy with every row stamped as sampled by policy ``version``."""
        return dataclasses.replace(self, policy_version=torch.full((len(self),), int(version), dtype=torch.long),
                                   token_version=None)

    def _per_row(self, values: Sequence[str], what: str) -> list[str]:
        if len(values) != self.num_prompts or len(self) % self.group_size:
            raise ValueError(f"{what} has {len(values)} entries but the rollout has {self.num_prompts} "
                             f"prompts ({len(self)} rows / group_size {self.group_size})")
        return [str(v) for v in values for _ in range(self.group_size)]

    # ------------------------------------------------------------- slicing
    def select(self, rows: slice | torch.Tensor | Sequence[int]) -> Rollout:
        """Rows `rows` (a slice, index tensor or bool mask) as a new Rollout; whole groups if it feeds group stats."""
        if isinstance(rows, slice):
            idx = torch.arange(len(self))[rows]
        else:
            idx = torch.as_tensor(rows)
            idx = idx.nonzero().squeeze(-1) if idx.dtype == torch.bool else idx.long()
        picked = idx.tolist()

        def pick(values: list[str]) -> list[str]:
            return [values[i] for i in picked] if values else []

        dev = self.prompt_ids.device
        i = idx.to(dev)
        return dataclasses.replace(
            self, prompt_ids=self.prompt_ids[i], prompt_mask=self.prompt_mask[i],
            response_ids=self.response_ids[i], response_mask=self.response_mask[i],
            sampling_logprobs=self.sampling_logprobs[i], group_index=self.group_index[i],
            finish_reason=pick(self.finish_reason), response_text=pick(self.response_text),
            ground_truth=pick(self.ground_truth), prompt_text=pick(self.prompt_text),
            policy_version=None if self.policy_version is None else self.policy_version[idx],
            token_version=None if self.token_version is None else self.token_version[i],
            context_mask=self.context_mask[i],
            episodes=None if self.episodes is None else self.episodes.select(idx))

    @classmethod
    def concat(cls, parts: Sequence[Rollout]) -> Rollout:
        """Stack rollouts row-wise (re-padding prompts left and responses right); group indices of
        later parts are offset so different parts never share a group."""
        if not parts:
            raise ValueError("Rollout.concat needs at least one rollout")
        g, pad = parts[0].group_size, parts[0].pad_token_id
        if any(p.group_size != g for p in parts):
            raise ValueError(f"Rollout.concat: group sizes differ: {[p.group_size for p in parts]}")
        for name in ("ground_truth", "prompt_text"):
            if len({bool(getattr(p, name)) for p in parts}) > 1:
                raise ValueError(f"Rollout.concat: {name} is set on some parts only")
        if len({p.episodes is None for p in parts}) > 1:
            raise ValueError("Rollout.concat: episodes is set on some parts only")
        lp = max(p.prompt_ids.shape[1] for p in parts)
        t = max(p.response_ids.shape[1] for p in parts)
        group_index, offset = [], 0
        for p in parts:
            group_index.append(p.group_index + offset)
            offset += int(p.group_index.max()) + 1 if len(p) else 0

        def cat(name: str, width: int, value: float | bool, left: bool) -> torch.Tensor:
            return torch.cat([_pad_columns(getattr(p, name), width, value, left) for p in parts])

        return cls(
            prompt_ids=cat("prompt_ids", lp, pad, True), prompt_mask=cat("prompt_mask", lp, False, True),
            response_ids=cat("response_ids", t, pad, False),
            response_mask=cat("response_mask", t, False, False),
            context_mask=cat("context_mask", t, False, False),
            sampling_logprobs=cat("sampling_logprobs", t, 0.0, False),
            finish_reason=[r for p in parts for r in p.finish_reason],
            response_text=[r for p in parts for r in p.response_text],
            group_index=torch.cat(group_index), group_size=g,
            ground_truth=[r for p in parts for r in p.ground_truth],
            prompt_text=[r for p in parts for r in p.prompt_text], pad_token_id=pad,
            policy_version=None if any(p.policy_version is None for p in parts)
            else torch.cat([p.policy_version for p in parts]),
            token_version=None if any(p.policy_version is None for p in parts)
            else torch.cat([_pad_columns(p.token_version, t, 0, False) for p in parts]),
            episodes=None if parts[0].episodes is None else EpisodeInfo.concat([p.episodes for p in parts]))


def row_lengths(seqs) -> list[int]:
    """Real tokens (prompt + response, context tokens included) of each row of a Rollout / TrainBatch."""
    lengths = seqs.prompt_mask.sum(dim=1) + seqs.response_mask.sum(dim=1)
    context = getattr(seqs, "context_mask", None)  # None: a single-turn batch
    if context is not None:
        lengths = lengths + context.sum(dim=1)
    return lengths.tolist()
