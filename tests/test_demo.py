"""The README's main job, shortened: `stapo train` on the built-in tiny CPU recipe, end to end
through the CLI (tiny model + tokenizer build, warm start, evaluation, RL, export, plots)."""

import json
import subprocess
import sys

import pytest

from stapo.telemetry.metrics import STEP_METRIC_KEYS


@pytest.mark.slow
def test_stapo_train_shortened_demo_writes_every_artifact(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "stapo.cli", "train", f"trainer.output_dir={out}", "trainer.total_steps=3",
         "tiny.warm_start_steps=20", "data.eval_size=16", "data.num_builtin_problems=256",
         "trainer.train_batch_size=8", "trainer.mini_batch_size=4", "trainer.save_every=2",
         "inspect.record_every=1", "logging.log_samples_every=1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the final summary
    assert "held-out accuracy (greedy):" in proc.stdout and "silenced tokens:" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in evals] == [0, 3]  # before and after
    assert all(k in r for r in steps for k in STEP_METRIC_KEYS)
    assert (out / "curves.png").stat().st_size > 10_000
    assert any((out / "tensorboard").iterdir())
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert len(list((out / "token_records").iterdir())) == 3
    assert len((out / "samples.jsonl").read_text().splitlines()) >= 3
    assert (out / "config.yaml").is_file()


@pytest.mark.slow
def test_lora_run_of_the_tiny_demo_learns(tmp_path):
    """The tiny CPU recipe with LoRA adapters (rank 16, lr 1e-3: LoRA needs a larger lr than the recipe's
    full-fine-tuning 5e-5) raises held-out greedy accuracy by >= 15 points in 4 iterations.

    Measured once with this exact command (seeds fixed): 45.0% -> 87.0% (+42 points), 18.6 min wall on
    the shared 2-core development box at load average ~8 (RL steps 6-8 s; the 600-step warm start is
    most of it). 15 points is over 4 standard errors of a 200-problem accuracy, and leaves room for the
    machine-dependent float sums of the warm start; the full warm start is kept because a weaker start
    does not learn (docs/demo.md)."""
    out = tmp_path / "demo_lora"
    proc = subprocess.run(
        [sys.executable, "-m", "stapo.cli", "train", f"trainer.output_dir={out}", "model.lora.enabled=true",
         "optim.lr=1e-3", "trainer.total_steps=4", "trainer.save_every=0", "inspect.record_every=0",
         "logging.log_samples_every=0", "logging.plot=false", "logging.tensorboard=false"],
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = [r["eval_accuracy"] for r in evals if "eval_accuracy" in r]
    assert after - before >= 0.15, (before, after)
    assert (out / "final" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_tiny_tir_demo_runs_from_its_recipe(tmp_path):
    """`stapo train stapo/recipes/tiny_tir.yaml` (docs/tir.md), shortened: the TIR tokenizer, model and warm
    start are built, episodes call the calculator, and both evaluations are logged."""
    from stapo.cli import builtin_recipe

    out = tmp_path / "tir"
    proc = subprocess.run(
        [sys.executable, "-m", "stapo.cli", "train", str(builtin_recipe("tiny_tir.yaml")), f"trainer.output_dir={out}",
         "trainer.total_steps=2", "tiny.warm_start_steps=40", "data.eval_size=16", "data.num_builtin_problems=256",
         "tiny.warm_start_tool_fraction=1.0",  # every warm-start example offered the tool calls it: so do the logged rows
         "trainer.train_batch_size=8", "trainer.mini_batch_size=4", "trainer.save_every=0", "trainer.eval_every=0",
         "inspect.record_every=0", "logging.log_samples_every=1", "logging.progress=false"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert all(r["tool_calls_mean"] > 0 and r["context_token_frac"] > 0 for r in steps)
    assert all("eval_no_tools_accuracy" in r and "eval_tool_calls_mean" in r for r in evals)
    assert "<tool_response>" in (out / "samples.jsonl").read_text()  # the samples show the tool turns
