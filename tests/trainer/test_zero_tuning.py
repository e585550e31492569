"""The ``zero:`` config section: JSON keys DeepSpeed accepts, validation, and exact 2-rank ZeRO-3
training with the tuned settings and with settings small enough to exercise every mechanism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist_utils import run_ranks, tiny_qwen3
from stapo.config import STAPOConfig, ZeroConfig
from stapo.config.loading import ConfigError
from stapo.trainer.components import zero_tuning
from stapo.distributed.deepspeed_engine import ZeroTuning, deepspeed_config

BASE = dict(grad_accum_steps=2, micro_batch_size=1, grad_clip=1.0, bf16=False, offload=False)
STAGE3_KEYS = {"stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
               "stage3_max_live_parameters", "stage3_max_reuse_distance"}
COMMON_KEYS = {"reduce_bucket_size", "overlap_comm", "contiguous_gradients"}


def test_config_section_reaches_the_deepspeed_json():
    cfg = STAPOConfig.from_dict({}, ["zero.prefetch_bucket_size=12345", "zero.overlap_comm=false"])
    zero = deepspeed_config(zero_stage=3, zero_tuning=zero_tuning(cfg), **BASE)["zero_optimization"]
    assert zero == {
        "stage": 3,
        "stage3_param_persistence_threshold": 1_000_000,
        "stage3_prefetch_bucket_size": 12345,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "reduce_bucket_size": 100_000_000,
        "overlap_comm": False,
        "contiguous_gradients": True,
    }
    # every field of the section has a DeepSpeed key (a new field without one would be silently dropped)
    assert {f.name for f in dataclasses.fields(ZeroConfig)} == {f.name for f in dataclasses.fields(ZeroTuning)}


def test_keys_follow_the_stage_and_none_leaves_deepspeed_defaults():
    tuning = zero_tuning(STAPOConfig())
    stage1 = deepspeed_config(zero_stage=1, zero_tuning=tuning, **BASE)["zero_optimization"]
    assert set(stage1) == {"stage"} | COMMON_KEYS  # stage3_* keys are not sent below stage 3
    stage0 = deepspeed_config(zero_stage=0, zero_tuning=tuning, **BASE)["zero_optimization"]
    assert stage0 == {"stage": 0}
    assert deepspeed_config(zero_stage=3, **BASE)["zero_optimization"] == {"stage": 3}
    partial = deepspeed_config(zero_stage=3, zero_tuning=ZeroTuning(reduce_bucket_size=7), **BASE)
    assert partial["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 7}


def test_deepspeed_parses_our_keys_into_its_fields():
    """Key names are DeepSpeed's own (aliases of its pydantic model), not look-alikes it would ignore."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = deepspeed_config(zero_stage=3, zero_tuning=zero_tuning(STAPOConfig()), **BASE)["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)
    for name, value in dataclasses.asdict(ZeroConfig()).items():
        assert getattr(parsed, name) == value, name


@pytest.mark.parametrize("override, message", [
    ("zero.max_live_parameters=1000", r"zero.max_live_parameters \(1000\) must be >= zero.prefetch_bucket_size"),
    ("zero.param_persistence_threshold=-1", "zero.param_persistence_threshold must be >= 0, got -1"),
    ("zero.reduce_bucket_size=0", "zero.reduce_bucket_size must be >= 1, got 0"),
])
def test_invalid_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_dict({}, [override])


# ---- 2 gloo ranks -----------------------------------------------------------------------------

LR, CLIP, GAS, WORLD = 1e-2, 1.0, 2, 2
# tiny_qwen3: hidden 16, 2 layers; norms have 16 (or 8) elements, every projection >= 128
STRESS = ZeroTuning(param_persistence_threshold=100, prefetch_bucket_size=300, max_live_parameters=600,
                    max_reuse_distance=300, reduce_bucket_size=500, overlap_comm=True,
                    contiguous_gradients=True)


def _data():
    """4 micro-batches of (1, 8) token ids; rank r gets micro-batches 2r and 2r + 1."""
    return torch.randint(0, 64, (4, 1, 8), generator=torch.Generator().manual_seed(3))


def _loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _train(tuning, rank):
    """Two optimizer steps with DeepSpeed's own API (grad = mean over ranks and micro-batches)."""
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.sync.buckets import iter_weight_buckets

    engine = build_engine(tiny_qwen3(seed=0), lr=LR, warmup_steps=0, grad_clip=CLIP, grad_accum_steps=GAS,
                          bf16=False, zero_tuning=tuning)
    ids = _data()
    persisted = sorted(n for n, p in engine.module.named_parameters() if p.ds_persist)
    norms = []
    for _ in range(2):
        for i in (2 * rank, 2 * rank + 1):
            engine.backward(_loss(engine, ids[i]))
            engine.step()  # only the second call (the boundary) steps
        norms.append(float(engine.get_global_grad_norm()))
    weights = {n: t.float().clone() for b in iter_weight_buckets(engine) for n, t in b}
    engine.destroy()
    return {"weights": weights, "norms": norms, "persisted": persisted}


def _zero_worker(out_dir, **_):
    from stapo.distributed.process_group import init_distributed

    info = init_distributed()
    return {"tuned": _train(zero_tuning(STAPOConfig()), info.rank), "stress": _train(STRESS, info.rank)}


def _reference():
    """Plain PyTorch: mean of the 4 micro-batch losses, clipped AdamW, two steps."""
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids, norms = _data(), []
    for _ in range(2):
        opt.zero_grad()
        (sum(_loss(model, ids[i]) for i in range(4)) / (GAS * WORLD)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.mark.distributed
@pytest.mark.slow
def test_two_rank_zero3_with_tuned_and_stress_settings_trains_exactly(tmp_path):
    results = run_ranks(_zero_worker, WORLD, tmp_path, timeout=240)
    ref_weights, ref_norms = _reference()
    assert ref_norms[0] > CLIP  # clipping is exercised
    for rank_result in results:
        for setting in ("tuned", "stress"):
            run = rank_result[setting]
            assert run["norms"] == pytest.approx(ref_norms, rel=1e-5), setting
            for name, ref in ref_weights.items():
                torch.testing.assert_close(run["weights"][name], ref, rtol=1e-5, atol=1e-6, msg=f"{setting} {name}")
        # tuned: the 1M threshold keeps the whole tiny model unpartitioned; stress: only norms stay whole
        assert len(rank_result["tuned"]["persisted"]) == len(ref_weights)
        assert rank_result["stress"]["persisted"] == sorted(n for n in ref_weights if "norm" in n)
