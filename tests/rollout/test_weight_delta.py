"""Delta weight syncs, the pure pieces (stapo/sync/weight_delta.py): which words changed, the size decision,
the payload's encoding, the checksum, and rank 0's copy of what the servers hold. Hand-checked values; the
servers' side runs in tests/rollout/test_server_delta.py (gloo) and tests/vllm_cpu/test_vllm_server_delta.py."""

from __future__ import annotations

import random

import pytest
import torch

from stapo.sync import weight_delta
from stapo.sync.bucket_format import pack_bucket_tensor
from stapo.sync.weight_delta import (SentWeights, TransferStats, apply_delta, changed_words, checksum, decode_delta,
                                        delta_nbytes, encode_delta, use_delta, word_bytes)

K = 0x9E3779B97F4A7C15  # weight_delta's mixing constant, unsigned


def reference_checksum(data: bytes) -> str:
    """The checksum's definition with Python integers (module docstring of weight_delta)."""
    total, whole = 0, len(data) // 8
    for i in range(whole):
        x = int.from_bytes(data[8 * i:8 * i + 8], "little") * K % 2**64
        shifted = x >> 31 | (((1 << 31) - 1) << 33 if x >> 63 else 0)  # arithmetic shift of an int64
        total += (x ^ shifted) * (2 * i + 1)
    tail = int.from_bytes(data[8 * whole:], "little")
    return f"{(total + tail * 0x2545F4914F6CDD1D) % 2**64:016x}-{len(data)}"


def bf16_flat(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint8)


def test_the_element_is_the_narrowest_dtype():
    assert word_bytes(["bfloat16", "float32"]) == 2 and word_bytes(["float32"]) == 4 and word_bytes([]) == 1


def test_delta_sizes_and_the_choice_by_hand():
    # 3 changed bf16 words of 1,000: 3 int32 positions = 12 bytes, padded to 16, + 3 values x 2 bytes = 22
    assert delta_nbytes(3, 1000, 2) == 22 and use_delta(3, 1000, 2)
    # a bucket of 96 bf16 words is 192 bytes; 31 changed: 124 -> 128 + 62 = 190 < 192; 32: 128 + 64 = 192, not less
    assert use_delta(31, 96, 2) and not use_delta(32, 96, 2)
    # fp32, 8 words = 32 bytes: 3 changed: 12 -> 16 + 12 = 28; 4 changed: 16 + 16 = 32 (the 1/2 crossover)
    assert use_delta(3, 8, 4) and not use_delta(4, 8, 4)
    # 2**31 words or more need int64 positions: 1 changed = 8 -> 16 + 2 = 18
    assert delta_nbytes(1, 2**31, 2) == 18 and delta_nbytes(0, 10, 2) == 0


def test_changed_words_compare_bits():
    old = bf16_flat([1.0, 2.0, 3.0, -0.0, float("nan")])
    new = bf16_flat([1.0, 2.5, 3.0, 0.0, float("nan")])
    assert changed_words(new, old, 2).tolist() == [1, 3]  # -0.0 and 0.0 are other bits; the same NaN is not
    with pytest.raises(ValueError, match="cannot be compared"):
        changed_words(new, old[:8], 2)


def test_a_delta_round_trips_and_applies():
    old, new = bf16_flat([1.0, 2.0, 3.0, 4.0]), bf16_flat([1.0, 2.5, 3.0, -4.0])
    positions = changed_words(new, old, 2)
    payload = encode_delta(new, positions, 2)
    # positions [1, 3] as int32 = 8 bytes, 8 bytes of padding, then the two bf16 values = 20 bytes
    assert payload.numel() == delta_nbytes(2, 4, 2) == 20
    assert payload[:8].view(torch.int32).tolist() == [1, 3] and payload[8:16].tolist() == [0] * 8
    got_positions, values = decode_delta(payload, 2, 4, 2)
    assert got_positions.tolist() == [1, 3] and values.view(torch.bfloat16).tolist() == [2.5, -4.0]
    apply_delta(old, got_positions, values, 2)
    assert torch.equal(old, new)


def test_a_delta_of_the_wrong_size_or_positions_is_refused():
    payload = encode_delta(bf16_flat([1.0, 2.0]), torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="a delta of 2 2-byte words is 20 bytes, got 18"):
        decode_delta(payload, 2, 2, 2)
    with pytest.raises(ValueError, match="outside the 1-word bucket"):
        decode_delta(payload, 1, 1, 2)


def test_the_checksum_by_hand():
    zeros = torch.zeros(19, dtype=torch.uint8)
    assert checksum(zeros) == "0000000000000000-19"  # zero words mix to zero; the byte count tells lengths apart
    one = torch.zeros(8, dtype=torch.uint8)
    one[0] = 1
    # x = 1 * K = 0x9E3779B97F4A7C15; x >> 31 (arithmetic: top bit set) = 0xFFFFFFFF3C6EF372;
    # x ^ that = 0x61C8864643248F67; times (2 * 0 + 1)
    assert checksum(one) == "61c8864643248f67-8"


@pytest.mark.parametrize("size", [0, 5, 8, 100, 1003])
def test_the_checksum_is_its_definition(size, monkeypatch):
    monkeypatch.setattr(weight_delta, "_CHUNK_WORDS", 4)  # several chunks: the chunked sum is the same sum
    data = bytes(random.Random(size).randrange(256) for _ in range(size))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else torch.zeros(0, dtype=torch.uint8)
    assert checksum(flat) == reference_checksum(data)


def test_the_checksum_sees_one_changed_byte_and_a_swap():
    flat = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    seen = {checksum(flat)}
    for position in (0, 1, 2047, 4095):
        changed = flat.clone()
        changed[position] ^= 1
        seen.add(checksum(changed))
    swapped = flat.clone().view(torch.int64)
    swapped[[3, 9]] = swapped[[9, 3]]
    seen.add(checksum(swapped.view(torch.uint8)))
    assert len(seen) == 6
    assert checksum(flat.clone()) == checksum(flat)


def _bucket(scale: float, n: int = 300) -> list[tuple[str, torch.Tensor]]:
    weights = (torch.linspace(-1, 1, n) * scale).to(torch.bfloat16)
    return [("a.weight", weights[:200].view(10, 20)), ("a.bias", weights[200:])]


def test_rank0s_copy_sends_the_bucket_then_its_changes():
    sent = SentWeights()
    layout, first = pack_bucket_tensor(_bucket(1.0))
    encoded = sent.encode(layout, first, delta=True)  # nothing to compare with yet: the bucket, whole
    assert encoded.header["encoding"] == "dense" and encoded.changed is None
    assert encoded.payload.numel() == encoded.dense_nbytes == 600  # 200 bf16 = 400 bytes (a multiple of 16: no padding) + 200 bytes
    assert encoded.header["checksum"] == checksum(first)
    bucket = _bucket(1.0)
    bucket[0][1][0, :5] += 1.0  # 5 of the 300 words change
    layout, second = pack_bucket_tensor(bucket)
    encoded = sent.encode(layout, second, delta=True)
    # 5 int32 positions = 20 bytes -> 32, + 5 bf16 values = 42 bytes instead of 600
    assert encoded.header["encoding"] == "delta" and encoded.changed == 5 and encoded.payload.numel() == 42
    assert encoded.header["checksum"] == checksum(second)
    assert torch.equal(next(iter(sent.buckets.values())), second)  # the copy follows what was sent
    unchanged = sent.encode(layout, second, delta=True)
    assert unchanged.header["encoding"] == "delta" and unchanged.payload.numel() == 0
    layout, dense = pack_bucket_tensor(_bucket(3.0))  # most words change: whole again
    assert sent.encode(layout, dense, delta=True).header["encoding"] == "dense"
    assert torch.equal(next(iter(sent.buckets.values())), dense)


def test_a_full_sync_still_counts_the_changes_and_a_new_layout_is_sent_whole():
    sent = SentWeights()
    layout, first = pack_bucket_tensor(_bucket(1.0))
    sent.encode(layout, first, delta=False)
    bucket = _bucket(1.0)
    bucket[1][1][:3] += 1.0
    layout, second = pack_bucket_tensor(bucket)
    full = sent.encode(layout, second, delta=False)
    assert full.header["encoding"] == "dense" and full.changed == 3
    layout, other = pack_bucket_tensor([("a.weight", bucket[0][1].reshape(20, 10))])  # another shape
    assert sent.encode(layout, other, delta=True).changed is None and len(sent.buckets) == 2
    sent.commit(3, {"127.0.0.1:1": "w0"})
    assert len(sent.buckets) == 2  # both were sent by this sync
    sent.encode(layout, other, delta=True)
    sent.commit(4, {"127.0.0.1:1": "w0"})
    assert len(sent.buckets) == 1  # the bucket the last sync did not send is dropped


def test_who_holds_rank0s_copy():
    sent = SentWeights()
    assert not sent.holds("h:1", "w0", [None])
    layout, flat = pack_bucket_tensor(_bucket(1.0))
    sent.encode(layout, flat, delta=True)
    sent.commit(5, {"h:1": "w0"})
    assert sent.holds("h:1", "w0", [5])
    assert not sent.holds("h:1", "w1", [5])  # restarted: another worker instance
    assert not sent.holds("h:1", "w0", [4])  # missed the last sync
    assert not sent.holds("h:2", "w0", [5])  # never committed this copy
    sent.invalidate()
    assert not sent.holds("h:1", "w0", [5]) and sent.nbytes == 0


def test_transfer_stats_add_up():
    stats = TransferStats()
    assert stats.changed_frac != stats.changed_frac  # NaN: nothing compared
    sent = SentWeights()
    layout, flat = pack_bucket_tensor(_bucket(1.0))
    stats.add(sent.encode(layout, flat, delta=True))  # 600 bytes, not compared
    bucket = _bucket(1.0)
    bucket[0][1][1, :6] -= 1.0
    layout, flat = pack_bucket_tensor(bucket)
    stats.add(sent.encode(layout, flat, delta=True))  # 6 of 300 words: 24 -> 32 + 12
    assert (stats.sent_bytes, stats.dense_bytes) == (600 + 44, 2 * 600)
    assert stats.changed_frac == 6 / 300
