"""GPU lane: `stapo train` end to end on one GPU in a plain process with vLLM, ZeRO-3 and bf16
(the engine itself, in and out of the trainer's group, is tested by tests/vllm_cpu on any platform).
Marked `gpu`; skipped without CUDA or vllm. Each run is a subprocess: vLLM and NCCL state never
leak between tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _require_gpu_and_vllm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]')")


def _plain_env() -> dict[str, str]:
    """This environment minus any launcher variables: `stapo train` as a user types it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _train(out: Path, *overrides: str) -> list[dict]:
    from stapo.telemetry.metrics import read_metrics

    args = [sys.executable, "-m", "stapo.cli", "train",
            f"trainer.output_dir={out}", "rollout.engine=vllm", "model.dtype=bf16", "trainer.zero_stage=3",
            "rollout.gpu_memory_utilization=0.3", "trainer.train_batch_size=32", "trainer.mini_batch_size=8",
            "trainer.micro_batch_size=64", "data.eval_size=64", "trainer.eval_every=0", "trainer.save_every=2",
            "inspect.record_every=0", "logging.log_samples_every=0", "logging.tensorboard=false",
            "logging.plot=false", "logging.progress=false", "optim.lr=1e-4", *overrides]
    proc = subprocess.run(args, env=_plain_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(out / "metrics.jsonl")


def _response_logprob(model_dir: Path, text: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum().item()


def test_stapo_train_with_vllm_in_one_plain_process_learns_syncs_and_resumes(tmp_path):
    out = tmp_path / "run"
    rows = _train(out, "trainer.total_steps=2")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # (a) new weights reach vLLM: after step 1's sync, step 2's sampler logprobs match the trainer's
    # teacher-forced ones up to bf16 kernel noise (a failed sync leaves the pre-update policy)
    assert "mismatch_logp_abs_mean" in steps[1], "the trainer does not log the mismatch metrics yet"
    assert steps[1]["mismatch_logp_abs_mean"] < 0.05
    # (b) training changed the policy: the exported model scores a fixed answer differently
    from stapo.config import STAPOConfig
    from stapo.trainer.components import resolve_model_path
    from stapo.distributed.process_group import DistInfo

    cfg = STAPOConfig.from_yaml(out / "config.yaml")
    initial = Path(resolve_model_path(cfg, DistInfo(0, 1, 0, torch.device("cpu"))))  # the cached tiny model
    text = "Compute 7+5-3+8-4. 7+5=12. 12-3=9. 9+8=17. 17-4=13. \\boxed{13}"
    assert abs(_response_logprob(out / "final", text) - _response_logprob(initial, text)) > 1e-3
    # (d) the checkpoint written on GPU resumes: step 3 continues from step 2
    rows = _train(out, "trainer.total_steps=3", "trainer.resume=auto")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
