"""Delta weight syncs into rollout servers (``rollout.server.sync: delta``; docs/rollout.md, "Delta syncs").

At RL learning rates most bf16 weights do not change in a step, so rank 0 keeps a host copy of what the servers
hold (`SentWeights`) and sends a bucket's changed words (positions and values, one broadcast) when that is
smaller. Functions of flat uint8 buckets, on whatever device holds them; torch only (vLLM's worker imports it).
`checksum` is integer arithmetic (the same value on every device): the byte count and a 64-bit sum over the
bucket's 8-byte words of ``mix(x) * (2 i + 1)`` (``mix``: an odd multiply and an xor-shift) plus its last
bytes, so a change confined to one word always changes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

__all__ = ["EncodedBucket", "SentWeights", "TransferStats", "apply_delta", "changed_words", "checksum",
           "decode_delta", "delta_nbytes", "encode_delta", "layout_key", "use_delta", "word_bytes"]

_ALIGN = 16  # the values of a delta start 16-byte aligned after its positions
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B97F4A7C15 - 2**64  # an odd 64-bit constant (2**64 / golden ratio) as a signed int64
_CHUNK_WORDS = 2**21  # the checksum's temporaries: 16 MiB per chunk of the bucket


def word_bytes(dtypes: list[str]) -> int:
    """The width of a bucket's elements: its narrowest dtype's (``dtypes``: the layout's names)."""
    sizes = [getattr(torch, name).itemsize for name in dtypes]
    return min(sizes) if sizes else 1


def layout_key(layout: dict) -> str:
    """A bucket's identity across syncs: its names, dtypes, shapes and offsets (another layout: sent whole)."""
    fields = [layout[k] for k in ("names", "dtypes", "shapes", "offsets", "nbytes")]
    return hashlib.sha1(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()[:20]


def _words(flat: torch.Tensor, word: int) -> torch.Tensor:
    """The bucket's bytes as integers of ``word`` bytes (a view)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() % word:
        raise ValueError(f"a bucket is a flat uint8 tensor of whole {word}-byte words, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    return flat.view(_WORD_DTYPES[word])


def _index_dtype(num_words: int) -> torch.dtype:
    return torch.int32 if num_words < 2**31 else torch.int64


def delta_nbytes(changed: int, num_words: int, word: int) -> int:
    """Bytes of a delta of ``changed`` words: positions (aligned to 16 bytes), then values.
    E.g. 3 changed bf16 words of 1,000: 12 bytes of int32 positions padded to 16, + 6 = 22."""
    positions = changed * _index_dtype(num_words).itemsize
    return positions + (-positions % _ALIGN) + changed * word


def use_delta(changed: int, num_words: int, word: int) -> bool:
    """Whether a delta of ``changed`` words is smaller than the ``num_words``-word bucket itself."""
    return delta_nbytes(changed, num_words, word) < num_words * word


def changed_words(new: torch.Tensor, old: torch.Tensor, word: int) -> torch.Tensor:
    """Positions (int64, ascending) of the ``word``-byte words in which two equally long buckets differ."""
    if new.numel() != old.numel():
        raise ValueError(f"buckets of {new.numel()} and {old.numel()} bytes cannot be compared")
    return torch.ne(_words(new, word), _words(old, word)).nonzero().squeeze(1)


def encode_delta(new: torch.Tensor, positions: torch.Tensor, word: int) -> torch.Tensor:
    """The delta payload (flat uint8, on ``new``'s device): ``positions`` of the changed words, then their
    values in ``new``."""
    num_words = new.numel() // word
    index = positions.to(_index_dtype(num_words)).view(torch.uint8)
    values = _words(new, word)[positions].view(torch.uint8)
    pad = torch.zeros(-index.numel() % _ALIGN, dtype=torch.uint8, device=new.device)
    return torch.cat([index, pad, values])


def decode_delta(payload: torch.Tensor, changed: int, num_words: int, word: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `encode_delta`: ``(positions int64, values)``; ValueError when the sizes disagree."""
    expected = delta_nbytes(changed, num_words, word)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(f"a delta of {changed} {word}-byte words is {expected} bytes, got {payload.numel()}")
    index_bytes = changed * _index_dtype(num_words).itemsize
    positions = payload[:index_bytes].view(_index_dtype(num_words)).long()
    if changed and (int(positions.min()) < 0 or int(positions.max()) >= num_words):
        raise ValueError(f"a delta names positions outside the {num_words}-word bucket")
    values = payload[expected - changed * word:].view(_WORD_DTYPES[word])
    return positions, values


def apply_delta(base: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, word: int) -> None:
    """Write ``values`` at ``positions`` of the bucket ``base``, in place."""
    _words(base, word)[positions.to(base.device)] = values.to(base.device)


def checksum(flat: torch.Tensor) -> str:
    """``"<64-bit hex>-<bytes>"`` of a flat uint8 tensor, computed where it lies (the sum: module docstring)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a checksum is taken of a flat uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    whole = flat.numel() // 8
    words = flat[:whole * 8].view(torch.int64)
    odd = torch.arange(min(whole, _CHUNK_WORDS), dtype=torch.int64, device=flat.device) * 2 + 1  # 2 j + 1
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, whole, _CHUNK_WORDS):
        x = words[start:start + _CHUNK_WORDS] * _MIX
        x ^= x >> 31
        # sum of x_j (2 (start + j) + 1) = sum of x_j (2 j + 1) + 2 start * sum of x_j   (mod 2**64)
        total += (x * odd[:x.numel()]).sum() + 2 * start * x.sum()
    tail = 0
    for i, byte in enumerate(flat[whole * 8:].tolist()):  # the last < 8 bytes
        tail |= byte << (8 * i)
    value = (int(total) + tail * 0x2545F4914F6CDD1D) % 2**64
    return f"{value:016x}-{flat.numel()}"


@dataclass(frozen=True)
class EncodedBucket:
    """What rank 0 sends for one bucket: ``header`` joins the layout's JSON, ``payload`` is broadcast."""

    header: dict  # encoding ("dense" | "delta"), word, changed, payload_nbytes, checksum (of the result)
    payload: torch.Tensor  # flat uint8 on the bucket's device
    dense_nbytes: int
    changed: int | None  # words changed since the copy; None: no copy of this bucket to compare with


@dataclass
class TransferStats:
    """One sync's bytes on the wire against the dense buckets', and the words that changed of those compared."""

    sent_bytes: int = 0
    dense_bytes: int = 0
    changed_words: int = 0
    compared_words: int = 0

    def add(self, encoded: EncodedBucket) -> None:
        self.sent_bytes += encoded.payload.numel()
        self.dense_bytes += encoded.dense_nbytes
        if encoded.changed is not None:
            self.changed_words += encoded.changed
            self.compared_words += encoded.dense_nbytes // encoded.header["word"]

    @property
    def changed_frac(self) -> float:
        """Fraction of the compared words that changed; NaN when no bucket had a copy to compare with."""
        return self.changed_words / self.compared_words if self.compared_words else float("nan")


class SentWeights:
    """Rank 0's host copy of the bytes the servers hold after the last sync, per bucket (keyed by its layout).

    ONE copy for all servers: a sync is one broadcast, so every server it commits holds the same bytes; one that
    does not (restarted, missed or failed a sync) makes the next sync full for all (`holds`)."""

    def __init__(self) -> None:
        self.buckets: dict[str, torch.Tensor] = {}  # layout key -> host uint8 bytes of the bucket
        self.version: int | None = None
        self.holders: dict[str, str] = {}  # server address -> its worker instance(s) when it committed
        self._sent: set[str] = set()  # keys sent by the sync in progress

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buckets.values())

    def holds(self, address: str, instance: str, versions: list) -> bool:
        """Whether a server (its worker instance and the version each worker reports) holds this copy."""
        return (self.version is not None and self.holders.get(address) == instance
                and all(v == self.version for v in versions))

    def encode(self, layout: dict, flat: torch.Tensor, delta: bool) -> EncodedBucket:
        """What to send for ``flat``: its changed words when ``delta`` and they are fewer bytes, else the bucket;
        the copy becomes ``flat``."""
        key, word = layout_key(layout), word_bytes(layout["dtypes"])
        num_words, old = flat.numel() // word, self.buckets.get(key)
        changed = positions = None
        if old is not None:  # on a GPU, the copy crosses to the device once; only the changes come back
            positions = changed_words(flat, old.to(flat.device), word)
            changed = positions.numel()
        if delta and changed is not None and use_delta(changed, num_words, word):
            payload, encoding = encode_delta(flat, positions, word), "delta"
            apply_delta(old, positions.cpu(), _words(flat, word)[positions].cpu(), word)
        else:
            payload, encoding = flat, "dense"
            if old is None:
                self.buckets[key] = flat.cpu()  # pack_bucket_tensor's bytes are its own: kept, not copied
            else:
                old.copy_(flat)
        self._sent.add(key)
        header = {"encoding": encoding, "word": word, "changed": changed if encoding == "delta" else num_words,
                  "payload_nbytes": payload.numel(), "checksum": checksum(flat)}
        return EncodedBucket(header, payload, flat.numel(), changed)

    def commit(self, version: int, holders: dict[str, str]) -> None:
        """The sync committed ``version`` on ``holders`` (address -> instance); buckets it did not send go."""
        self.buckets = {k: v for k, v in self.buckets.items() if k in self._sent}
        self.version, self.holders, self._sent = version, dict(holders), set()

    def invalidate(self) -> None:
        """No server is known to hold the copy (a sync committed nowhere): free it; the next sync is full."""
        self.buckets, self.version, self.holders, self._sent = {}, None, {}, set()
