"""Bucketed ZeRO-3 weight gathering: one all-gather per bucket, equal to the single-process model.

Distributed tests run 2 gloo CPU ranks on a tiny Qwen3 with odd-sized tensors (vocab 63, hidden
15: the 63x15 = 945-element embedding and the 15-element norms split as 473 + 472 + 1 padding),
so DeepSpeed's padded partition layout is exercised.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from _dist_utils import run_ranks, tiny_qwen3
from stapo.distributed.flat_gather import flat_layout, pack_partitions, unpack_partitions
from stapo.sync.buckets import (StateDictConsumer, hf_name, iter_weight_buckets,
                                       iter_weights_per_param, plan_buckets, sync_weights)

# 1 B: smaller than any parameter (one bucket each); 2 KiB: a few small tensors per bucket
# (the 63x15 fp32 embedding is 3780 B, alone); 256 MiB: the whole model in one bucket.
BUCKET_SIZES = [1, 2048, 256 * 2**20]
MODEL = dict(seed=3, vocab_size=63, hidden_size=15)
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")


class _CountGathers:
    """Counts the all-gathers issued through ``torch.distributed`` while active (this rank)."""

    def __enter__(self):
        import torch.distributed as dist

        self.count, self._saved = 0, {}
        for name in _GATHERS:
            if hasattr(dist, name):
                self._saved[name] = fn = getattr(dist, name)
                setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _gather(model, size):
    with _CountGathers() as gathers:
        buckets = [[(n, t.clone()) for n, t in b] for b in iter_weight_buckets(model, size)]
    return buckets, gathers.count


def _gather_worker(out_dir, **_):
    import deepspeed

    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import build_engine

    init_distributed()
    engine = build_engine(tiny_qwen3(**MODEL), lr=1e-3, warmup_steps=0, grad_accum_steps=1,
                          bf16=False)
    out = {size: _gather(engine, size) for size in BUCKET_SIZES}
    out["per_param"] = [b for b in iter_weights_per_param(engine.module)]
    # Every other parameter already gathered (ds_status AVAILABLE): read in place, the rest
    # flat-gathered; no nested GatheredParameters (DeepSpeed refuses overlapping contexts).
    subset = list(engine.module.named_parameters())[::2]
    out["available"] = {hf_name(n) for n, _ in subset}
    with deepspeed.zero.GatheredParameters([p for _, p in subset], modifier_rank=None):
        out["mixed_status"] = sorted({p.ds_status.name for p in engine.module.parameters()})
        out["mixed"] = _gather(engine, 2048)
    plain = tiny_qwen3(**{**MODEL, "seed": 99})  # different init: sync must overwrite every weight
    out["stats"] = sync_weights(engine, StateDictConsumer(plain), bucket_bytes=2048)
    ids = torch.arange(12).reshape(2, 6)
    out["synced_logits"] = plain(input_ids=ids).logits.detach()
    bf16 = build_engine(tiny_qwen3(**MODEL), lr=1e-3, warmup_steps=0, grad_accum_steps=1,
                        bf16=True)
    out["bf16"] = _gather(bf16, 2048)
    return out


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    return run_ranks(_gather_worker, 2, tmp_path_factory.mktemp("sync"), timeout=240)


def _reference(dtype=torch.float32):
    return {n: p.detach().to(dtype) for n, p in tiny_qwen3(**MODEL).named_parameters()}


def _check_buckets(buckets, ref, size):
    assert [n for b in buckets for n, _ in b] == list(ref)  # every param once, HF names, in order
    for bucket in buckets:
        for name, tensor in bucket:
            assert tensor.dtype == ref[name].dtype and torch.equal(tensor, ref[name]), name
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        assert nbytes <= size or len(bucket) == 1  # bounded, unless one tensor exceeds it


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("size", BUCKET_SIZES)
def test_bucketed_gather_is_the_full_state_dict_with_one_gather_per_bucket(gathered, size):
    ref = _reference()
    assert ref["model.embed_tokens.weight"].numel() % 2 == 1  # padding path: 945 = 473 + 472
    for rank_result in gathered:
        buckets, n_gathers = rank_result[size]
        _check_buckets(buckets, ref, size)
        assert n_gathers == len(buckets)  # ONE collective per bucket, none per parameter
    n_buckets = len(gathered[0][size][0])
    if size == 1:
        assert n_buckets == len(ref)
    elif size == 2048:
        assert 1 < n_buckets < len(ref)
    else:
        assert n_buckets == 1


@pytest.mark.distributed
@pytest.mark.slow
def test_already_gathered_params_are_read_in_place(gathered):
    ref = _reference()
    for rank_result in gathered:
        assert rank_result["mixed_status"] == ["AVAILABLE", "NOT_AVAILABLE"]
        buckets, n_gathers = rank_result["mixed"]
        _check_buckets(buckets, ref, 2048)
        partitioned = [b for b in buckets if any(n not in rank_result["available"] for n, _ in b)]
        assert n_gathers == len(partitioned) < len(buckets)  # none for all-AVAILABLE buckets


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_gather_is_exact(gathered):
    ref = _reference(torch.bfloat16)
    for rank_result in gathered:
        buckets, n_gathers = rank_result["bf16"]
        _check_buckets(buckets, ref, 2048)
        assert n_gathers == len(buckets)


@pytest.mark.distributed
@pytest.mark.slow
def test_per_param_baseline_and_sync_into_plain_model(gathered):
    ref = _reference()
    model = tiny_qwen3(**MODEL)
    expected_logits = model(input_ids=torch.arange(12).reshape(2, 6)).logits.detach()
    for rank_result in gathered:
        per_param = rank_result["per_param"]
        assert [len(b) for b in per_param] == [1] * len(ref)
        assert all(torch.equal(b[0][1], ref[b[0][0]]) for b in per_param)
        stats = rank_result["stats"]
        assert stats.num_tensors == len(ref)
        assert stats.num_bytes == 4 * sum(t.numel() for t in ref.values())  # fp32
        torch.testing.assert_close(rank_result["synced_logits"], expected_logits, rtol=0, atol=0)


def _fake_zero3_param(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A stand-in for a ZeRO-3 param on ``rank``: DeepSpeed's layout, P = ceil(numel / world)."""
    part_numel = -(-full.numel() // world)
    padded = torch.cat([full.reshape(-1), full.new_full((part_numel * world - full.numel(),), 7)])
    param = torch.empty(0, dtype=full.dtype)
    param.ds_tensor = padded[rank * part_numel:(rank + 1) * part_numel].clone()
    param.ds_tensor.ds_numel = part_numel
    param.ds_numel, param.ds_shape = full.numel(), full.shape
    return param


def test_pack_unpack_round_trips_deepspeed_layout_on_three_ranks():
    fulls = [torch.arange(15.0).reshape(5, 3),  # P = ceil(15/3) = 5: no padding
             torch.arange(7.0).to(torch.bfloat16),  # P = 3: last rank holds 1 + 2 padding
             torch.tensor([[1.5, -2.0], [3.0, 4.0]])]  # P = 2: last rank is all padding
    ranks = [[_fake_zero3_param(f, r, 3) for f in fulls] for r in range(3)]
    slots, row_bytes = flat_layout(ranks[0])
    # bytes: 5*4 = 20 → 32 (16-aligned); 3*2 = 6 → 16; 2*4 = 8 → 16
    assert [s.offset for s in slots] == [0, 32, 48] and row_bytes == 64
    assert [s.part_numel for s in slots] == [5, 3, 2]
    rows = torch.stack([pack_partitions([p.ds_tensor for p in params], slots,
                                        torch.empty(row_bytes, dtype=torch.uint8))
                        for params in ranks])  # (3, 64) as the all-gather leaves them
    rebuilt = unpack_partitions(rows, slots)
    for full, tensor in zip(fulls, rebuilt):
        assert tensor.dtype == full.dtype and torch.equal(tensor, full)  # padding (7s) dropped
    rebuilt[0][0, 0] = 100.0  # owns its storage: the gather buffer is untouched
    assert rows[0, :4].view(torch.float32).item() == 0.0


def test_plan_buckets_greedy_and_order_preserving():
    # budget 8: [4, 4] fills it, 8 alone, 2 alone at the end
    assert plan_buckets([4, 4, 8, 2], 8) == [[0, 1], [2], [3]]
    # 20 exceeds the budget: its own bucket; neighbours are not merged across it
    assert plan_buckets([3, 20, 3, 3], 8) == [[0], [1], [2, 3]]
    assert plan_buckets([], 8) == []
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_buckets([1], 0)


def test_hf_name_strips_wrapper_prefixes():
    assert hf_name("module.model.norm.weight") == "model.norm.weight"
    assert hf_name("module._orig_mod.lm_head.weight") == "lm_head.weight"
    assert hf_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"


def test_plain_module_gather_includes_persistent_buffers_and_loads_strictly():
    src = torch.nn.BatchNorm1d(3)  # weight, bias + persistent buffers (running stats, count)
    with torch.no_grad():
        src.weight.fill_(2.0)
        src.running_mean.fill_(0.5)
    dst = torch.nn.BatchNorm1d(3)
    buckets = list(iter_weight_buckets(src, bucket_bytes=12))  # 12 B = one 3-float tensor
    assert [[n for n, _ in b] for b in buckets] == [
        ["weight"], ["bias"], ["running_mean", "running_var", "num_batches_tracked"]]
    dst.load_state_dict({n: t for b in buckets for n, t in b}, strict=True)
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.running_mean, src.running_mean)
    copied = list(iter_weight_buckets(src, bucket_bytes=12))[0][0][1]
    assert copied.data_ptr() != src.weight.data_ptr()  # copy=True: the caller may keep it


def test_consumer_rejects_unknown_names():
    with pytest.raises(KeyError, match="'nope' is not a parameter or buffer of Linear"):
        StateDictConsumer(torch.nn.Linear(2, 2)).load_weights([("nope", torch.zeros(1))])


def test_sync_loads_every_bucket_inside_one_update_session():
    # the rollout engines' contract (docs/rollout.md): begin, every bucket, finish — once per sync
    class Recorder:
        last_sync = None

        def __init__(self):
            self.calls = []

        @contextlib.contextmanager
        def weight_update(self, version=None):
            self.calls.append("begin")
            yield
            self.calls.append("finish")

        def load_weights(self, bucket):
            self.calls.append([name for name, _ in bucket])

    src = torch.nn.BatchNorm1d(3)
    recorder = Recorder()
    stats = sync_weights(src, recorder, bucket_bytes=12)
    assert recorder.calls == ["begin", ["weight"], ["bias"], ["running_mean", "running_var", "num_batches_tracked"],
                              "finish"]
    assert stats.num_buckets == 3 and stats.num_tensors == 5
