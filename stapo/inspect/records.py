"""Token records: what the trainer saves every ``inspect.record_every`` steps for the inspector (docs/inspector.md).

``kept`` / ``silenced`` are the mask's decisions only; a token ``rejected`` by ``loss.rollout_rs`` is out of the
loss either way. Older records read as weight = kept, none rejected, and STAPO's default thresholds.

The file is a ``torch.save`` of a plain dict (``weights_only=True``) with the texts interned into one UTF-8 blob
and int32 indices: a record of 2M tokens holds 12M strings, which ``weights_only`` unpickling reads slowly.
Use :func:`read_token_record`, not ``torch.load``.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stapo.losses.builtin_masks import DEFAULT_ENTROPY_QUANTILE, DEFAULT_TAU_P  # the paper's, as the stapo mask
from stapo.run_dir import RECORDS_DIR, token_record_paths

FORMAT_VERSION = 1
_TENSORS = {  # field -> (dtype, ndim)
    "row": (torch.long, 1), "position": (torch.long, 1), "token_id": (torch.long, 1),
    "logprob": (torch.float32, 1), "entropy": (torch.float32, 1),
    "advantage": (torch.float32, 1), "kept": (torch.bool, 1), "silenced": (torch.bool, 1),
    "topk_ids": (torch.long, 2), "topk_probs": (torch.float32, 2), "collision": (torch.float32, 1),
    "weight": (torch.float32, 1), "rejected": (torch.bool, 1),
}


@dataclass
class RecordRow:
    """One response of the recorded mini-batch. ``context``: a multi-turn episode's context segments
    (tool output and template tokens, docs/tir.md) as ``[position of its first token, text]``; they hold
    no record entries (never trained) but belong in the text around the policy's tokens."""

    row: int
    prompt_text: str
    response_text: str
    reward: float
    advantage: float
    context: list = field(default_factory=list)


@dataclass
class TokenRecord:
    """Per-token statistics of one mini-batch (see the module docstring for shapes)."""

    step: int
    minibatch: int
    mask_name: str
    thresholds: dict[str, float]
    rows: list[RecordRow]
    row: torch.Tensor         # (N,) long, index into ``rows`` by RecordRow.row
    position: torch.Tensor    # (N,) long, token index within the response
    token_id: torch.Tensor    # (N,) long
    token_text: list[str]     # (N)
    logprob: torch.Tensor     # (N,) f32, log π(y_t) of the sampled token
    entropy: torch.Tensor     # (N,) f32
    advantage: torch.Tensor   # (N,) f32
    kept: torch.Tensor        # (N,) bool
    silenced: torch.Tensor    # (N,) bool
    topk_ids: torch.Tensor    # (N, K) long
    topk_probs: torch.Tensor  # (N, K) f32
    topk_text: list[list[str]]  # (N x K)
    collision: torch.Tensor   # (N,) f32, Σ π²
    weight: torch.Tensor | None = None  # (N,) f32, the mask's token weight; None: kept as 1 / 0
    rejected: torch.Tensor | None = None  # (N,) bool, rejected by the off-policy correction; None: none

    def __post_init__(self) -> None:
        self.rows = [r if isinstance(r, RecordRow) else RecordRow(**r) for r in self.rows]
        if self.weight is None and isinstance(self.kept, torch.Tensor):
            self.weight = self.kept.float()
        if self.rejected is None and isinstance(self.kept, torch.Tensor):
            self.rejected = torch.zeros_like(self.kept)
        self.thresholds = default_thresholds(self.thresholds, self.entropy)
        self.validate()

    @property
    def num_tokens(self) -> int:
        return int(self.row.numel())

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field with a wrong dtype, rank or length."""
        where = f"token record step={self.step} minibatch={self.minibatch}"
        n = self.row.numel() if isinstance(self.row, torch.Tensor) else -1
        for name, (dtype, ndim) in _TENSORS.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != ndim:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"{where}: field {name!r} must be a {ndim}-d {dtype} tensor, "
                                 f"got {got}")
            if t.shape[0] != n:
                raise ValueError(f"{where}: field {name!r} has {t.shape[0]} entries, row has {n}")
        k = self.topk_ids.shape[1]
        if self.topk_probs.shape[1] != k:
            raise ValueError(f"{where}: topk_probs has {self.topk_probs.shape[1]} columns, "
                             f"topk_ids {k}")
        if len(self.token_text) != n or len(self.topk_text) != n:
            raise ValueError(f"{where}: token_text/topk_text need {n} entries, got "
                             f"{len(self.token_text)}/{len(self.topk_text)}")
        if any(len(alts) != k for alts in self.topk_text):
            raise ValueError(f"{where}: every topk_text entry needs {k} strings (topk_ids width)")
        if bool((self.kept & self.silenced).any()):
            raise ValueError(f"{where}: a token is both kept and silenced")
        if not torch.equal(self.weight > 0, self.kept):
            raise ValueError(f"{where}: weight > 0 must be exactly the kept tokens")
        unknown = set(self.row.unique().tolist()) - {r.row for r in self.rows}
        if unknown:
            raise ValueError(f"{where}: token rows {sorted(unknown)[:5]} are not in rows")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rows"] = [asdict(r) for r in self.rows]
        return out


def default_thresholds(thresholds: dict[str, Any], entropy: torch.Tensor) -> dict[str, float]:
    """``tau_p``/``tau_h`` as floats; missing or NaN ones (masks without them, ``none``, ``entropy_top``) get
    STAPO's defaults (docs/losses.md): ``τ_p = 2e-3`` and ``τ_h`` = the 0.8 quantile of the record's entropies.
    """
    out = {k: float(v) for k, v in thresholds.items()}
    if not math.isfinite(out.get("tau_p", math.nan)):
        out["tau_p"] = DEFAULT_TAU_P
    if math.isnan(out.get("tau_h", math.nan)):
        out["tau_h"] = _quantile(entropy, DEFAULT_ENTROPY_QUANTILE)
    return out


def _quantile(values: torch.Tensor, q: float) -> float:
    """``torch.quantile``'s linear interpolation without its input-size limit (numpy's); 0 when empty."""
    if not isinstance(values, torch.Tensor) or values.numel() == 0:
        return 0.0
    return float(np.quantile(values.detach().double().flatten().numpy(), q))


def write_token_record(path: str | Path, record: TokenRecord | dict[str, Any]) -> Path:
    """Validate and save atomically (temp file + rename): a killed run never leaves half a file."""
    if isinstance(record, dict):
        record = TokenRecord(**record)
    else:
        record.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    data = record.to_dict()
    data.update(_pack_texts(data.pop("token_text"), data.pop("topk_text")))
    torch.save(data, tmp)
    os.replace(tmp, path)
    return path


def read_token_record(path: str | Path) -> TokenRecord:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt or foreign file: say which one
        raise ValueError(f"cannot read token record {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict, got {type(data).__name__}")
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: token record format_version {data.get('format_version')!r}, "
                         f"this stapo reads {FORMAT_VERSION}")
    names = {f.name for f in fields(TokenRecord)} - {"token_text", "topk_text"}
    missing = (names - _OPTIONAL | set(_PACKED)) - data.keys()
    if missing:
        raise ValueError(f"{path}: token record misses fields {sorted(missing)}")
    token_text, topk_text = _unpack_texts(data)
    return TokenRecord(**{k: data[k] for k in names if k in data}, token_text=token_text, topk_text=topk_text)


_OPTIONAL = {"weight", "rejected"}  # fields records written by an earlier stapo may lack
_PACKED = ("text_bytes", "text_offsets", "token_text_idx", "topk_text_idx")


def _pack_texts(token_text: list[str], topk_text: list[list[str]]) -> dict[str, Any]:
    """Intern the strings: one UTF-8 blob + offsets, and int32 indices into it."""
    table: dict[str, int] = {}
    token_idx = [table.setdefault(t, len(table)) for t in token_text]
    topk_idx = [[table.setdefault(t, len(table)) for t in row] for row in topk_text]
    encoded = [t.encode("utf-8") for t in table]
    offsets = [0, *itertools.accumulate(len(e) for e in encoded)]
    k = len(topk_text[0]) if topk_text else 0
    blob = b"".join(encoded)
    text_bytes = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob  # (bytes,)
                  else torch.zeros(0, dtype=torch.uint8))  # frombuffer rejects empty buffers
    return {"format_version": FORMAT_VERSION, "text_bytes": text_bytes,
            "text_offsets": torch.tensor(offsets, dtype=torch.long),
            "token_text_idx": torch.tensor(token_idx, dtype=torch.int32),
            "topk_text_idx": torch.tensor(topk_idx, dtype=torch.int32).view(len(topk_idx), k)}


def _unpack_texts(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    blob = data["text_bytes"].numpy().tobytes()
    off = data["text_offsets"].tolist()
    table = [blob[a:b].decode("utf-8") for a, b in zip(off[:-1], off[1:])]
    token_text = [table[i] for i in data["token_text_idx"].tolist()]
    topk_text = [[table[i] for i in row] for row in data["topk_text_idx"].tolist()]
    return token_text, topk_text


def load_records(run_dir: str | Path) -> list[TokenRecord]:
    """All records of a run, ordered by (step, mini-batch); a clear error when there are none."""
    found = token_record_paths(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no token records in {Path(run_dir) / RECORDS_DIR}: train with inspect.record_every=N (e.g. "
            f"`stapo train CONFIG inspect.record_every=10`) to record token statistics")
    return [read_token_record(p) for p in found]
