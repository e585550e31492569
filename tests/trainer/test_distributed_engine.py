"""ZeRO-3 engine on 2 gloo CPU ranks: exact gradient sums, clipping + AdamW + warm-up, NaN skip,
parameter partitioning, metric reduction; plus the single-process (no launcher) path."""

from __future__ import annotations

import math
import os

import pytest
import torch

from _dist_utils import run_ranks, tiny_qwen3
from stapo.distributed.deepspeed_engine import deepspeed_config, warmup_factor

LR, WARMUP, CLIP = 1e-2, 2, 1.0
# 4 micro-batches of 6 tokens = 5 next-token targets each; valid targets 5 + 3 + 4 + 2 = 14.
VALID = [5, 3, 4, 2]
N_GLOBAL = sum(VALID)


def _data():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 1, 6), generator=gen)  # (micro, 1, 6)
    masks = torch.zeros(4, 1, 5)
    for i, n in enumerate(VALID):
        masks[i, 0, :n] = 1.0
    return ids, masks


def _loss(model, ids, mask):
    """Masked token NLL normalized by the GLOBAL valid count (what the trainer does)."""
    logits = model(input_ids=ids).logits[:, :-1].float()  # (1, 5, V)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (1, 5)
    return -(logp * mask).sum() / N_GLOBAL


def _weights(model):
    from stapo.sync.buckets import iter_weight_buckets

    return {n: t.float() for b in iter_weight_buckets(model) for n, t in b}


def _engine_worker(out_dir, **_):
    from _dist_utils import gather_full_grads
    from stapo.distributed.process_group import barrier, init_distributed, reduce_metrics
    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.deepspeed_engine import build_engine, current_lr

    info = init_distributed()
    with pytest.raises(ValueError, match="initial weights differ across ranks"):
        build_engine(tiny_qwen3(seed=info.rank), lr=LR, warmup_steps=0, grad_accum_steps=1, bf16=False)
    engine = build_engine(tiny_qwen3(seed=0), lr=LR, warmup_steps=WARMUP, grad_clip=CLIP,
                          grad_accum_steps=2, bf16=False)
    ids, masks = _data()
    mine = [2 * info.rank, 2 * info.rank + 1]  # rank 0: micro 0, 1; rank 1: micro 2, 3
    out = {"info": info}
    out["partition"] = [(n, p.ds_numel, p.ds_tensor.numel()) for n, p in engine.module.named_parameters()]
    out["w0"] = _weights(engine)

    def one_step(scale=1.0):
        accumulation = GradientAccumulation(engine, len(mine))
        for i in mine:
            accumulation.backward(_loss(engine, ids[i], masks[i]) * scale)
        grads = gather_full_grads(engine)
        return grads, accumulation.step()

    out["grads1"], out["step1"] = one_step()
    out["w1"], out["lr1"] = _weights(engine), current_lr(engine)
    _, out["step_nan"] = one_step(scale=float("nan"))
    out["w_nan"], out["lr_nan"] = _weights(engine), current_lr(engine)
    _, out["step2"] = one_step()
    out["w2"] = _weights(engine)
    with pytest.raises(RuntimeError, match="step called after 0 of 2 micro-batch backwards"):
        GradientAccumulation(engine, 2).step()
    out["metrics"] = reduce_metrics({"reward_sum": torch.tensor(info.rank + 1.0), "count": 2})
    barrier()
    return out


def _reference():
    """Single-process plain PyTorch on the concatenated data: step, (skipped), step."""
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_factor(s, WARMUP))
    ids, masks = _data()
    results = []
    for _ in range(2):
        opt.zero_grad()
        sum(_loss(model, ids[i], masks[i]) for i in range(4)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        opt.step()
        sched.step()
        results.append((grads, norm, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_engine_worker, 2, tmp_path_factory.mktemp("engine"), timeout=180)


@pytest.mark.distributed
@pytest.mark.slow
def test_dist_info_and_collectives(two_ranks):
    assert [r["info"].rank for r in two_ranks] == [0, 1]
    assert {r["info"].world_size for r in two_ranks} == {2}
    assert [r["info"].is_main for r in two_ranks] == [True, False]
    # reward sums 1 + 2 = 3, counts 2 + 2 = 4, identical on both ranks
    assert [r["metrics"] for r in two_ranks] == [{"reward_sum": 3.0, "count": 4.0}] * 2


@pytest.mark.distributed
@pytest.mark.slow
def test_parameters_are_partitioned_across_ranks(two_ranks):
    total_full = total_local = 0
    for rank_result in two_ranks:
        for name, full, local in rank_result["partition"]:
            assert local == math.ceil(full / 2), name  # each rank owns half (padded)
            total_local += local
    for name, full, _ in two_ranks[0]["partition"]:
        total_full += full
    assert total_full == sum(p.numel() for p in tiny_qwen3().parameters())
    assert total_full <= total_local <= total_full + 2 * len(two_ranks[0]["partition"])


@pytest.mark.distributed
@pytest.mark.slow
def test_gradient_is_exact_sum_over_ranks_and_micro_batches(two_ranks):
    ref_grads = _reference()[0][0]
    for rank_result in two_ranks:
        grads = rank_result["grads1"]
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)
    # a 2x mean-over-ranks or a 1/gas factor would show up as a norm ratio of 2 or 0.5
    ref_norm = torch.sqrt(sum((g**2).sum() for g in ref_grads.values())).item()
    assert two_ranks[0]["step1"].grad_norm == pytest.approx(ref_norm, rel=1e-5)
    assert ref_norm > CLIP  # so clipping is exercised by the next test


@pytest.mark.distributed
@pytest.mark.slow
def test_step_matches_clipped_adamw_with_warmup(two_ranks):
    (_, _, ref_w1), (_, ref_norm2, ref_w2) = _reference()
    for rank_result in two_ranks:
        assert rank_result["step1"].applied
        assert rank_result["lr1"] == pytest.approx(LR)  # step 0 ran at LR/2, step 1 will run at LR
        for name, ref in ref_w1.items():
            torch.testing.assert_close(rank_result["w1"][name], ref, rtol=1e-5, atol=1e-6, msg=name)
        # the NaN step in between was skipped, so step 2 equals the reference's second step
        assert rank_result["step2"].applied
        assert rank_result["step2"].grad_norm == pytest.approx(ref_norm2, rel=1e-5)
        for name, ref in ref_w2.items():
            torch.testing.assert_close(rank_result["w2"][name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_non_finite_loss_skips_the_step(two_ranks):
    for rank_result in two_ranks:
        assert rank_result["step_nan"].applied is False
        assert rank_result["step_nan"].grad_norm == math.inf
        assert rank_result["lr_nan"] == rank_result["lr1"]  # scheduler did not advance
        for name, w in rank_result["w1"].items():
            assert torch.equal(rank_result["w_nan"][name], w), name
        assert all(torch.isfinite(w).all() for w in rank_result["w2"].values())


def _single_process_worker(out_dir, **_):
    from stapo.distributed.process_group import init_distributed
    from _dist_utils import gather_full_grads
    from stapo.distributed.accumulation import GradientAccumulation, backward_sum
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.sync.buckets import iter_weight_buckets

    info = init_distributed()
    env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    engine = build_engine(tiny_qwen3(seed=0), lr=LR, warmup_steps=0, grad_accum_steps=1, bf16=False)
    ids, masks = _data()
    with pytest.raises(ValueError, match="loss does not require grad"):
        backward_sum(engine, torch.tensor(0.0), last=True)  # would deadlock ZeRO-3 peers: refused
    accumulation = GradientAccumulation(engine, 1)
    accumulation.backward(_loss(engine, ids[0], masks[0]))
    with pytest.raises(RuntimeError, match="call step"):
        accumulation.backward(_loss(engine, ids[0], masks[0]))
    out = {"info": info, "env": env, "step": accumulation.step(),
           "zero_stage": engine.zero_optimization_stage()}
    # bf16 (the GPU setting) also builds and steps on DeepSpeed's CPU accelerator
    bf16 = build_engine(tiny_qwen3(seed=0), lr=LR, warmup_steps=0, grad_accum_steps=1, bf16=True)
    accumulation = GradientAccumulation(bf16, 1)
    accumulation.backward(_loss(bf16, ids[0], masks[0]))
    out["bf16_grads"] = gather_full_grads(bf16)
    out["bf16_step"] = accumulation.step()
    out["bf16_dtypes"] = {t.dtype for b in iter_weight_buckets(bf16) for _, t in b}
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_single_process_without_launcher(tmp_path):
    (result,) = run_ranks(_single_process_worker, 1, tmp_path, launcher=False, timeout=120)
    assert (result["info"].rank, result["info"].world_size, result["info"].local_rank) == (0, 1, 0)
    assert result["info"].device == torch.device("cpu")
    # only LOCAL_RANK is added (DeepSpeed reads it); the rendezvous used a tcp:// URL
    assert result["env"] == {"LOCAL_RANK": "0", "RANK": None, "WORLD_SIZE": None, "MASTER_PORT": None}
    assert result["step"].applied and result["zero_stage"] == 3
    assert result["bf16_step"].applied and result["bf16_dtypes"] == {torch.bfloat16}
    # bf16 grads of micro-batch 0 alone (5 of 14 tokens) vs the fp32 reference: loose tolerance
    model = tiny_qwen3(seed=0)
    ids, masks = _data()
    _loss(model, ids[0], masks[0]).backward()
    for name, p in model.named_parameters():
        assert result["bf16_grads"][name].dtype == torch.float32
        torch.testing.assert_close(result["bf16_grads"][name], p.grad, rtol=0.1, atol=2e-3, msg=name)


def test_warmup_factor_is_linear_then_constant():
    # warmup 4: (0+1)/4, (1+1)/4, (2+1)/4, (3+1)/4, then 1
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_deepspeed_config_maps_flat_arguments():
    cfg = deepspeed_config(grad_accum_steps=4, micro_batch_size=2, grad_clip=1.0, zero_stage=3,
                           bf16=True, offload=True)
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_build_engine_rejects_bad_arguments():
    from stapo.distributed.deepspeed_engine import build_engine

    with pytest.raises(ValueError, match=r"lr must be > 0.*grad_accum_steps must be >= 1"):
        build_engine(torch.nn.Linear(2, 2), lr=0.0, warmup_steps=0, grad_accum_steps=0, bf16=False)


def test_reduce_metrics_without_process_group_is_identity_in_float():
    from stapo.distributed.process_group import reduce_metrics

    assert reduce_metrics({"reward_sum": torch.tensor(2.5), "count": 3}) == {"reward_sum": 2.5, "count": 3.0}
    assert reduce_metrics({}) == {}
    with pytest.raises(ValueError, match=r"not scalar: \['bad'\]"):
        reduce_metrics({"ok": 1.0, "bad": torch.ones(3)})


def test_incomplete_launcher_environment_is_reported(monkeypatch):
    from stapo.distributed.process_group import init_distributed

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"\['RANK'\] are set but \['WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        init_distributed(backend="gloo")
