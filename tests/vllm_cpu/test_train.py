"""`stapo train` / `stapo eval` with rollout.engine=vllm on vLLM's platform (CPU in CI): one process,
two torchrun ranks with ZeRO-3, resume. Each run is a subprocess (vLLM state never leaks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _bounds import assert_steps_fp32_noise
from conftest import FP32_LOGPROB_BOUND, run

from stapo.run_dir import METRICS_FILE, SAMPLES_FILE, read_metrics

pytestmark = pytest.mark.timeout(1800)
COMMON = ["rollout.engine=vllm", "trainer.train_batch_size=8", "trainer.mini_batch_size=4",
          "trainer.micro_batch_size=64", "rollout.group_size=4", "rollout.max_response_length=40",
          "data.eval_size=16", "trainer.eval_every=0", "inspect.record_every=0", "logging.log_samples_every=1",
          "logging.tensorboard=false", "logging.plot=false", "logging.progress=false", "optim.lr=2e-4",
          "trainer.export_hf=true", "model.dtype=fp32"]  # fp32 on a GPU too: the bound is an fp32 bound


def train(out: Path, model_dir: Path, *overrides: str, launcher: tuple[str, ...] = ()) -> list[dict]:
    cmd = [*(launcher or (sys.executable,)), "-m", "stapo.cli", "train", f"model.path={model_dir}",
           f"trainer.output_dir={out}", *COMMON, *overrides]
    run(cmd)
    return [r for r in read_metrics(out / METRICS_FILE) if "loss" in r]


def samples_of(out: Path, step: int) -> list[str]:
    rows = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    return [r["response"] for r in rows if r["step"] == step]


def fixed_answer_logprob(model_dir: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([tok("Compute 7+5-3+8-4. 7+5=12. 12-3=9. 9+8=17. 17-4=13. \\boxed{13}")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum().item()


def test_vllm_samples_from_the_trainers_policy_after_every_sync(colocated_run, warm_model_dir):
    out, steps = colocated_run
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # step 1 samples the loaded weights; steps 2-4 the weights synced after each update: a sync that
    # leaves any layer behind shows up here (before the tied-head fix: a mean of 4e-4 .. 1e-3 on this model)
    assert_steps_fp32_noise(steps, "colocated run")
    assert fixed_answer_logprob(out / "final") != pytest.approx(fixed_answer_logprob(warm_model_dir), abs=1e-3)


def test_resumed_run_regenerates_the_same_rollouts(colocated_run, warm_model_dir, tmp_path):
    out, steps = colocated_run
    resumed = tmp_path / "run"
    train(resumed, warm_model_dir, "trainer.total_steps=2", "trainer.save_every=1")  # steps 1-2
    (resumed / "checkpoints").joinpath("latest").write_text("step_1")  # as if killed during step 2
    again = train(resumed, warm_model_dir, "trainer.total_steps=3", "trainer.save_every=1", "trainer.resume=auto")
    assert [r["step"] for r in again] == [1, 2, 3]
    for step in (2, 3):
        assert samples_of(resumed, step) == samples_of(out, step)
        here = next(r for r in again if r["step"] == step)
        ref = next(r for r in steps if r["step"] == step)
        assert here["reward_mean"] == ref["reward_mean"] and here["response_length_mean"] == ref["response_length_mean"]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="an engine per rank needs 2 GPUs")
def test_two_torchrun_ranks_with_zero3_and_an_engine_each(warm_model_dir, tmp_path):
    """Each rank's ZeRO-3 state is moved to the host while its engine starts and generates
    (rollout.offload_training_state; exactness: tests/trainer/test_training_offload.py)."""
    out = tmp_path / "ranks2"
    steps = train(out, warm_model_dir, "trainer.total_steps=2", "trainer.save_every=0", "trainer.zero_stage=3",
                  "rollout.offload_training_state=true",
                  launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"))
    assert [r["step"] for r in steps] == [1, 2]
    # two engines on 2 cores and a 2-rank recompute: 1.4e-5 on the EPYC (2.5x one engine's figure); 10x the
    # bound, still over 30x under a stale sync (tests/vllm_cpu/_bounds.py)
    assert_steps_fp32_noise(steps, "2 ranks, ZeRO-3, an engine each", bound=10 * FP32_LOGPROB_BOUND)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="TP of 2 needs 2 GPUs")
def test_two_ranks_share_one_tensor_parallel_engine(warm_model_dir, tmp_path):
    """rollout.tensor_parallel_size=2: both ranks run ONE engine (a shard each), submit the union of
    their prompts and keep their own rows; every sync lands in both shards, so the sampler's
    logprobs stay at fp32 noise from the trainer's recompute."""
    out = tmp_path / "tp2"
    steps = train(out, warm_model_dir, "trainer.total_steps=2", "trainer.save_every=0", "trainer.zero_stage=3",
                  "rollout.tensor_parallel_size=2",
                  launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"))
    assert [r["step"] for r in steps] == [1, 2]
    # the TP-2 engine sums its shards' partial products: 1.4e-5 on the EPYC; 10x the bound as above
    assert_steps_fp32_noise(steps, "2 ranks, one TP-2 engine", bound=10 * FP32_LOGPROB_BOUND)
    assert all(r["time_rollout_max"] >= r["time_rollout_min"] > 0 for r in steps)  # both ranks generated
    if not torch.cuda.is_available():  # vLLM's CPU shared memory: no name left for the next run to trip on
        assert not [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("-tp:0-[0-1]-cpushm_")]


def eval_final(out: Path, data: Path, dest: Path, tensor_parallel_size: int = 1) -> list[str]:
    """`stapo eval` of the run's final/ on ``data`` (2 samples, 32 tokens); its samples.jsonl lines."""
    run([sys.executable, "-m", "stapo.cli", "eval", str(out / "final"), "--data", str(data), "--engine", "vllm",
         "--samples", "2", "--max-new-tokens", "32", "--settings", "train", "--out", str(dest),
         "--tensor-parallel-size", str(tensor_parallel_size)],
        **({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tensor_parallel_size == 2 and not torch.cuda.is_available()
           else {}))  # vLLM's CPU workers need a core each, named, on one NUMA node
    return (dest / "samples.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory) -> Path:
    from stapo.tiny import arithmetic_problems

    data = tmp_path_factory.mktemp("eval_data") / "arith.jsonl"
    data.write_text("".join(json.dumps({"problem": p.question, "answer": p.answer}) + "\n"
                            for p in arithmetic_problems(8, seed=3)))
    return data


@pytest.fixture(scope="module")
def one_worker_eval(colocated_run, eval_data, tmp_path_factory):
    dest = tmp_path_factory.mktemp("eval") / "tp1"
    return dest, eval_final(colocated_run[0], eval_data, dest)


def test_stapo_eval_with_vllm(one_worker_eval):
    dest, lines = one_worker_eval
    assert json.loads((dest / "results.json").read_text())["engine"] == "vllm"
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 8 and all(len(r["responses"]) == 2 for r in rows)  # 8 problems x 2 samples


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="TP of 2 needs 2 GPUs")
def test_stapo_eval_over_a_tensor_parallel_engine(colocated_run, eval_data, one_worker_eval, tmp_path):
    """--tensor-parallel-size 2: vLLM's own two workers (one process of ours); per-request seeds, so
    the same samples as one worker (on CPU in fp32 they came out identical)."""
    assert eval_final(colocated_run[0], eval_data, tmp_path / "tp2", tensor_parallel_size=2) == one_worker_eval[1]


def test_lora_run_syncs_the_merged_adapters(warm_model_dir, tmp_path):
    # LoRA (docs/lora.md): buckets carry W + (alpha/r) B A under the base names, through the same update
    # session; a sync that dropped the adapters would leave vLLM on the base weights at step 2
    steps = train(tmp_path / "lora", warm_model_dir, "trainer.total_steps=2", "trainer.save_every=0",
                  "model.lora.enabled=true", "optim.lr=1e-3", "trainer.export_hf=false")
    assert [r["step"] for r in steps] == [1, 2]
    # the max, not the mean (3.8e-7): the trainer's W x + s B A x against vLLM's merged W': 1.1e-5 on the EPYC
    assert_steps_fp32_noise(steps, "LoRA run")
