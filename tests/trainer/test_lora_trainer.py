"""STAPOTrainer with ``model.lora`` end to end on the tiny model (single process, real DeepSpeed, real
PEFT): frozen base, KL to the adapters-disabled policy, adapter-only checkpoints that resume exactly,
``final/`` as an adapter (and merged model) that PEFT, plain ``from_pretrained`` and ``stapo eval``
load; and one 2-rank ZeRO-3 run. The engine-level multi-rank pieces are in test_lora.py."""

from __future__ import annotations

import pytest
import torch

from stapo.config import STAPOConfig
from stapo.run_dir import FINAL_DIR, MERGED_DIR, read_metrics

from _rewards import alternating_reward

pytestmark = pytest.mark.slow

IDS = torch.tensor([[3, 17, 40, 9, 11, 25]])


def lora_config(out, model_dir, data, *extra: str) -> STAPOConfig:
    return STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"trainer.output_dir={out}",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
        "rollout.group_size=4", "rollout.max_response_length=10", "optim.lr=1e-2", "optim.warmup_steps=0",
        "mask.params={tau_p: 0.05}", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "trainer.save_every=0", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", *extra,
    ])


def _raw(module) -> dict[str, torch.Tensor]:
    """Every parameter of the PEFT model (gathered under ZeRO-3), by its PEFT name."""
    import deepspeed

    params = list(module.named_parameters())
    partitioned = [p for _, p in params if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        return {n: p.detach().clone() for n, p in params}


@pytest.mark.parametrize("stage,dtype,extra", [
    (3, "fp32", ("loss.kl_coef=0.1", "trainer.max_tokens_per_micro_batch=48", "model.lora.export_merged=true")),
    (1, "bf16", ("trainer.total_steps=1", "trainer.packing=false")),  # bf16 needs stage >= 1
])
def test_lora_run_trains_adapters_only_and_exports_them(stage, dtype, extra, tmp_path, tiny_model_dir,
                                                        arithmetic_jsonl):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from stapo import STAPOTrainer
    from stapo.evaluation.adapter import loadable_model_dir
    from stapo.evaluation.runner import check_model_dir

    out = tmp_path / "run"
    cfg = lora_config(out, tiny_model_dir, arithmetic_jsonl, f"trainer.zero_stage={stage}", f"model.dtype={dtype}",
                      "trainer.total_steps=2", *extra)
    trainer = STAPOTrainer(cfg, reward_fn=alternating_reward())
    before = _raw(trainer.model)
    trainer.train()
    after = _raw(trainer.model)
    assert trainer.reference is None or trainer.reference.model is trainer.model  # no second copy
    base = [n for n in before if ".lora_" not in n]
    assert base and all(torch.equal(before[n], after[n]) for n in base)  # frozen, bit for bit
    assert any(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    if cfg.loss.kl_coef > 0:  # the reference is the base: KL > 0 once the adapters moved
        assert all(r["kl"] > 0 for r in rows)

    # the checkpoint holds the adapters (the base is rebuilt from model.path on resume). DeepSpeed's
    # exclude_frozen_parameters walks named_parameters(), which lists the tied embedding once, so
    # its lm_head alias stays: an empty placeholder under ZeRO-3, the tied matrix at stage 0
    states = next((out / "checkpoints").glob("step_*/zero/*model_states.pt"))
    saved = torch.load(states, weights_only=False, map_location="cpu")["module"]
    base_saved = [k for k in saved if ".lora_" not in k]
    assert any(".lora_" in k for k in saved) and base_saved == ["base_model.model.lm_head.weight"]
    if stage == 3:
        assert saved[base_saved[0]].numel() == 0

    final = out / FINAL_DIR
    assert (final / "adapter_config.json").is_file() and not (final / "config.json").exists()
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    base_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=dt)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base_model, str(final))(input_ids=IDS).logits.float()
        trained = trainer.model(input_ids=IDS).logits.float()
        torch.testing.assert_close(peft_logits, trained, rtol=0, atol=1e-5 if dtype == "fp32" else 0.02)
        assert check_model_dir(final) == final
        with loadable_model_dir(final) as merged_dir:  # what `stapo eval final/` loads
            evaluated = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=dt)(input_ids=IDS).logits.float()
        torch.testing.assert_close(evaluated, peft_logits, rtol=0, atol=1e-5 if dtype == "fp32" else 0.05)
        if cfg.model.lora.export_merged:
            merged = AutoModelForCausalLM.from_pretrained(str(final / MERGED_DIR))(input_ids=IDS).logits
            torch.testing.assert_close(merged, peft_logits, rtol=0, atol=1e-5)
    assert not merged_dir.exists()  # the temporary merge is cleaned up


COMPARED = ("reward_mean", "loss", "grad_norm", "entropy_mean", "silenced_frac", "kl", "lr")


def test_lora_resume_is_exact(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """3 steps straight == 2 steps, a new trainer resuming from the step-2 checkpoint, 1 more step
    (ZeRO-3: the adapters' fp32 partitions, Adam moments, lr schedule and RNG come back)."""
    from stapo import STAPOTrainer

    args = ("loss.kl_coef=0.1", "trainer.save_every=1", "trainer.export_hf=false")
    straight, split = tmp_path / "straight", tmp_path / "split"
    STAPOTrainer(lora_config(straight, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=3", *args),
                 reward_fn=alternating_reward()).train()
    STAPOTrainer(lora_config(split, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=2", *args),
                 reward_fn=alternating_reward()).train()
    resumed = STAPOTrainer(lora_config(split, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=3", *args),
                           reward_fn=alternating_reward())
    assert resumed.step_count == 2
    resumed.train()

    def by_step(out):
        return {int(r["step"]): r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}

    expected, got = by_step(straight), by_step(split)
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    assert expected[3]["grad_norm"] > 0
    for step in (1, 2, 3):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)


def _two_rank_worker(out_dir, model_dir, data):
    from stapo import STAPOTrainer

    cfg = lora_config(f"{out_dir}/run", model_dir, data, "trainer.zero_stage=3", "loss.kl_coef=0.1",
                      "trainer.total_steps=2", "zero.param_persistence_threshold=0")
    trainer = STAPOTrainer(cfg, reward_fn=alternating_reward())
    before = _raw(trainer.model)
    trainer.train()
    after = _raw(trainer.model)
    with torch.no_grad():
        policy = trainer.model(input_ids=IDS).logits  # collective under ZeRO-3: every rank runs it
        engine = trainer.rollout_engine.model(input_ids=IDS).logits  # the merged weights of the last sync
    base = [n for n in before if ".lora_" not in n]
    return dict(base_frozen=all(torch.equal(before[n], after[n]) for n in base),
                adapters_moved=any(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n),
                policy=policy, engine=engine, kl=[r["kl"] for r in read_metrics(out_dir + "/run/metrics.jsonl")
                                                  if "loss" in r])


@pytest.mark.distributed
def test_two_rank_zero3_lora_run_syncs_merged_weights_and_exports_the_adapter(tmp_path, tiny_model_dir,
                                                                               arithmetic_jsonl):
    """2 ranks, ZeRO-3 with every tensor partitioned: the trainer's sync leaves each rank's HF engine with
    the merged policy, the KL reference is the base, and rank 0's final/ adapter reproduces the policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from _dist_utils import run_ranks

    results = run_ranks(_two_rank_worker, 2, tmp_path, timeout=420,
                        kwargs={"model_dir": str(tiny_model_dir), "data": str(arithmetic_jsonl)})
    for rank in results:
        assert rank["base_frozen"] and rank["adapters_moved"] and all(k > 0 for k in rank["kl"])
        torch.testing.assert_close(rank["engine"], rank["policy"], rtol=0, atol=1e-5)
    final = tmp_path / "ranks__two_rank_worker" / "run" / FINAL_DIR
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        exported = PeftModel.from_pretrained(base, str(final))(input_ids=IDS).logits
    torch.testing.assert_close(exported, results[0]["policy"], rtol=0, atol=1e-5)
