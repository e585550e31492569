"""`stapo train --dry-run`: every recipe checks offline on CPU; a broken run fails with train's message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stapo.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
TINY = str(ROOT / "examples" / "recipes" / "tiny_cpu.yaml")


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a dry run never needs the hub
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)  # recipes' relative output_dirs land here


def _dry_run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["train", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_offline_on_cpu(recipe, capsys):
    code, out, err = _dry_run(capsys, str(recipe), "--world-size", "8")
    assert code == 0, err
    assert "stapo train --dry-run: the config is valid" in out
    assert "ranks: 8   steps: " in out and "tokens per step, upper bound: " in out


def test_the_summary_is_the_runs_arithmetic(capsys):
    # tiny recipe: 32 prompts x G=8, mini-batch 8 prompts, micro 64 rows, 56 + 128 tokens per row
    code, out, _ = _dry_run(capsys, TINY, "--world-size", "2", "trainer.max_tokens_per_micro_batch=100")
    assert code == 0
    assert "ranks: 2   steps: 100   optimizer steps: 400 (4 per step)" in out
    assert "256 responses (per rank: 16 prompts, 128 responses)" in out
    assert "mini-batch per rank: 32 rows; micro-batches: <= 100 tokens each (a row holds <= 184)" in out
    assert "rows longer than the budget get a micro-batch of their own" in out
    assert "tokens per step, upper bound: 256 x 184 = 47,104 (generated: <= 14,336)" in out
    assert "mask: stapo (tau_p=0.002, entropy_quantile=0.8)" in out
    assert "\nmask:\n  name: stapo\n" in out  # the resolved config comes first


def test_world_size_comes_from_the_launcher(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "ranks: 4 " in _dry_run(capsys, TINY)[1]
    monkeypatch.setenv("WORLD_SIZE", "3")  # 32 prompts do not split over 3 ranks
    code, _, err = _dry_run(capsys, TINY)
    assert code == 2 and "trainer.train_batch_size (32) must be divisible by the number of ranks (3)" in err
    code, _, err = _dry_run(capsys, TINY, "--world-size", "2")  # the option wins
    assert code == 0, err


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ("mask.params.tau=0.1", "mask.params: unknown parameter(s) ['tau'] for mask 'stapo'"),
    ("rollout.group_size=1", "rollout.group_size (G) must be >= 2"),
    ("trainer.mini_batch_size=5", "trainer.mini_batch_size (5) must divide trainer.train_batch_size (32)"),
    ("rollout.tensor_parallel_size=2", "rollout.tensor_parallel_size 2 needs the vllm engine (this run: hf)"),
])
def test_a_broken_override_fails_with_the_message_train_gives(override, message, capsys, tmp_path):
    code, out, err = _dry_run(capsys, TINY, override)
    assert code == 2 and message in err and not out, err
    assert main(["train", TINY, override, f"trainer.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == err


def test_output_dir_resume_or_new(capsys, tmp_path):
    run = tmp_path / "run"
    assert "(a new run)" in _dry_run(capsys, TINY, f"trainer.output_dir={run}")[1]
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "the earlier run's files move to" in _dry_run(capsys, TINY, f"trainer.output_dir={run}")[1]
    step = run / "checkpoints" / "step_25"
    (step / "zero").mkdir(parents=True)
    (step / "client_state.pt").write_bytes(b"")  # a save cut short: nothing else to resume
    code, _, err = _dry_run(capsys, TINY, f"trainer.output_dir={run}")
    assert code == 2 and f"{step}: client_state.pt cannot be read" in err and "trainer.resume=never" in err, err
    torch.save({"world_size": 1}, step / "client_state.pt")
    torch.save({}, step / "zero" / "mp_rank_00_model_states.pt")
    assert f"(resumes from {step})" in _dry_run(capsys, TINY, f"trainer.output_dir={run}")[1]
    code, _, err = _dry_run(capsys, TINY, f"trainer.resume={tmp_path / 'missing'}")
    assert code == 2 and "trainer.resume: checkpoint" in err and "does not exist" in err


def test_the_reward_function_is_imported_and_its_signature_checked(capsys, tmp_path):
    example = ROOT / "examples" / "reward_function.py"
    code, out, err = _dry_run(capsys, TINY, f"reward.function={example}:boxed_with_level")
    assert code == 0 and "reward: reward.function" in out, err
    one_arg = tmp_path / "one_arg.py"
    one_arg.write_text("def score(response):\n    return 1.0\n")
    code, _, err = _dry_run(capsys, TINY, f"reward.function={one_arg}:score")
    assert code == 2 and "cannot be called as fn(response, ground_truth, **fields)" in err, err
    code, _, err = _dry_run(capsys, TINY, f"reward.function={example}:missing")
    assert code == 2 and "has no attribute 'missing'" in err, err


def test_what_this_machine_lacks_is_reported_not_fatal(capsys, monkeypatch):
    from stapo.rollout import registry

    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    code, out, _ = _dry_run(capsys, TINY, "rollout.engine=vllm", "model.path=stapo-tests/no-such-model")
    assert code == 0
    assert "not on this machine: the vllm rollout engine needs vLLM" in out
    assert "not on this machine: model.path 'stapo-tests/no-such-model' is not a local directory" in out
    assert "rollout: colocated, engine auto -> hf" in _dry_run(capsys, TINY, "rollout.engine=auto")[1]


def test_world_size_without_dry_run_is_an_error(capsys):
    assert main(["train", TINY, "--world-size", "2"]) == 2
    assert "--world-size applies to --dry-run only" in capsys.readouterr().err


def test_server_mode_needs_no_colocated_engine(capsys, monkeypatch):
    """docs/rollout.md's command: the recipe says ``rollout.engine: vllm``, but in server mode the servers run
    vLLM and the trainer runs no engine, so neither the package nor the engine is checked; the summary shows
    the mode, the servers (and that they do not answer now), the staleness and the correction."""
    from stapo.rollout import registry
    from stapo.trainer.preflight import plan_run

    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    recipe = str(ROOT / "examples" / "recipes" / "qwen3_8b_stapo.yaml")
    code, out, err = _dry_run(capsys, recipe, "rollout.mode=server", "rollout.server.addresses=[127.0.0.1:9]",
                              "rollout.max_staleness=1", "--summary")
    assert code == 0, err
    assert "needs vLLM" not in out and "rollout.engine" not in out
    assert "  rollout: server mode, 1 server(s) 127.0.0.1:9; asynchronous, max_staleness 1; weight sync full\n" in out
    assert "not on this machine: rollout server 127.0.0.1:9 does not answer now" in out
    assert "off-policy correction: token-level importance weights" in out
    assert out.startswith("stapo train --dry-run: the config is valid") and "the resolved config" not in out
    from stapo.config import STAPOConfig

    plan = plan_run(STAPOConfig.from_yaml(recipe, ["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:9]",
                                                   "model.path=stapo-tests/no-such-model"]), 8, data=False)
    assert plan.engine == "server" and plan.engine_problem is None and plan.run_problems == []


def test_the_summary_shows_lora_tools_lr_and_kl(capsys):
    code, out, _ = _dry_run(capsys, TINY, "--summary", "loss.kl_coef=0.001", "optim.lr=2e-5")
    assert code == 0
    assert "; full fine-tuning (no LoRA)\n" in out and "  tools: off\n" in out
    assert "  optimizer: AdamW lr 2e-05 (warm-up 0 steps), clip ratio to [0.8, 1.28]\n" in out
    assert "  KL to the initial policy: k3 x 0.001\n" in out
    code, out, _ = _dry_run(capsys, "qwen3_8b_stapo_lora", "--summary", "--world-size", "8")
    assert "; LoRA rank 16, alpha 32 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj\n" in out
    code, out, _ = _dry_run(capsys, "qwen3_8b_stapo_tir", "--summary", "--world-size", "8")
    assert "  tools: python (timeout_s=" in out and "stateful=True" in out and "; parser qwen3, <= " in out
