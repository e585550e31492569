"""Resuming checks what it resumes (stapo/config/experiment.py, stapo/trainer/resume.py): a checkpoint of
another experiment is refused with the keys and the two ways on, safe changes are allowed and logged.

The fast tests use hand-built checkpoint directories (a client_state.pt holding a config, as the trainer
writes it); the slow one is the ablation end to end: a STAPO run, then ``mask.name=none`` on the same recipe.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from stapo.cli import main
from stapo.config import STAPOConfig
from stapo.config.experiment import (EXPERIMENT_KEYS, RUN_SETTINGS, config_changes, flat_keys, is_experiment_key,
                                     listed_in)
from stapo.trainer.resume import ExperimentChanged, resume_changes

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "recipes" / "tiny_cpu.yaml")


def _all_keys(section, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out += _all_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def test_every_config_key_is_either_the_experiment_or_a_run_setting():
    """A new config field must be classified: it fails here until it is in one of the two lists."""
    for key in _all_keys(STAPOConfig()):
        where = listed_in(key, EXPERIMENT_KEYS) + listed_in(key, RUN_SETTINGS)
        assert len(where) == 1, f"{key}: classified by {where or 'nothing'} (stapo/config/experiment.py)"


def test_changes_are_classified():
    saved = STAPOConfig.from_yaml(TINY).to_dict()
    now = STAPOConfig.from_yaml(TINY, ["mask.name=none", "trainer.total_steps=200", "trainer.eval_every=5",
                                       "model.lora.enabled=true", "trainer.output_dir=elsewhere",
                                       "trainer.train_batch_size=16", "trainer.micro_batch_size=8"]).to_dict()
    changes = config_changes(saved, now, step=40)
    assert changes.experiment == ("model.lora.enabled: False -> True", "mask.name: 'stapo' -> 'none'",
                                  "mask.params: {'tau_p': 0.002, 'entropy_quantile': 0.8} -> {}",
                                  "trainer.train_batch_size: 32 -> 16")
    assert changes.settings == ("trainer.total_steps: 100 -> 200", "trainer.micro_batch_size: 64 -> 8",
                                "trainer.eval_every: 25 -> 5")
    fewer = config_changes(saved, STAPOConfig.from_yaml(TINY, ["trainer.total_steps=30"]).to_dict(), step=40)
    assert fewer.experiment == ("trainer.total_steps: 100 -> 30 (below the checkpoint's step 40)",)
    assert config_changes(saved, STAPOConfig.from_yaml(TINY, ["trainer.total_steps=40"]).to_dict(), 40).experiment == ()
    del saved["loss"]["entropy_coef"]  # a checkpoint from a stapo without that field: not compared
    assert config_changes(saved, STAPOConfig.from_yaml(TINY, ["loss.entropy_coef=0.1"]).to_dict(), 1).experiment == ()
    assert is_experiment_key("rollout.tools.params") and not is_experiment_key("rollout.tools.max_workers")
    assert "mask.params" in flat_keys(saved) and "model.lora.rank" in flat_keys(saved)


def _checkpoint(out: Path, step: int, cfg: STAPOConfig) -> Path:
    """A checkpoint as stapo.trainer.checkpoint writes it, with a ZeRO model-states file."""
    path = out / "checkpoints" / f"step_{step}"
    (path / "zero").mkdir(parents=True)
    torch.save({"world_size": 1, "step": step, "client_state": {"step": step, "config": cfg.to_dict()}},
               path / "client_state.pt")
    torch.save({}, path / "zero" / "mp_rank_00_model_states.pt")
    (out / "checkpoints" / "latest").write_text(path.name)
    return path


def test_resume_changes_refuses_another_experiment_under_auto_only(tmp_path):
    run = tmp_path / "run"
    path = _checkpoint(run, 40, STAPOConfig.from_yaml(TINY, [f"trainer.output_dir={run}"]))
    ablation = STAPOConfig.from_yaml(TINY, ["mask.name=none", f"trainer.output_dir={run}"]).to_dict()
    with pytest.raises(ExperimentChanged) as refused:
        resume_changes(path, ablation, "auto", run)
    assert str(refused.value) == (
        f"trainer.output_dir {run} holds step_40 of another experiment (mask.name: 'stapo' -> 'none'; mask.params: "
        "{'tau_p': 0.002, 'entropy_quantile': 0.8} -> {}): resuming would continue it under these settings. Train into "
        f"another directory (trainer.output_dir={run}-name-none) or continue it anyway (trainer.resume=force)")
    for how in ("force", str(path)):  # forced, or the checkpoint named by its path: continued, with the changes
        assert resume_changes(path, ablation, how, run).experiment[0] == "mask.name: 'stapo' -> 'none'"


def test_the_dry_run_and_train_refuse_allow_and_log(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    checkpoint = _checkpoint(run, 40, STAPOConfig.from_yaml(TINY, [f"trainer.output_dir={run}"]))
    for extra in ([], ["--dry-run"]):  # train stops in its preflight, before any model is built
        assert main(["train", TINY, f"trainer.output_dir={run}", "model.lora.enabled=true", *extra]) == 2
        err = capsys.readouterr().err
        assert f"holds step_40 of another experiment (model.lora.enabled: False -> True)" in err, err
        assert f"(trainer.output_dir={run}-enabled-True) or continue it anyway (trainer.resume=force)" in err
    with caplog.at_level(logging.INFO, logger="stapo.trainer"):
        assert main(["train", TINY, f"trainer.output_dir={run}", "trainer.total_steps=200", "logging.plot=false",
                     "--dry-run", "--summary"]) == 0
    out = capsys.readouterr().out
    changed = "trainer.total_steps: 100 -> 200; logging.plot: True -> False"
    assert f"output_dir: {run} (resumes from {checkpoint}; changed since: {changed})" in out
    assert f"resuming {checkpoint} with changed run settings: {changed}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stapo.trainer"):
        assert main(["train", TINY, f"trainer.output_dir={run}", "mask.name=none", "trainer.resume=force",
                     "--dry-run", "--summary"]) == 0
    assert "changed since: mask.name: 'stapo' -> 'none'" in capsys.readouterr().out
    assert "trainer.resume=force: continuing" in caplog.text and "trainer.resume=force" in caplog.text


def test_an_ablation_on_the_same_recipe_never_continues_the_stapo_run(tmp_path, tiny_model_dir, arithmetic_jsonl,
                                                                      capsys):
    """The issue's case end to end: a STAPO run from a recipe, then ``mask.name=none`` on the same recipe:
    refused (nothing trained, the STAPO run untouched) with the fix; the fix trains the baseline in its own
    directory; the STAPO run itself resumes for more steps (a safe change). Three one-step trainings in this
    process, ~5 s."""
    recipe = tmp_path / "recipe.yaml"
    STAPOConfig.from_yaml(TINY, [
        f"model.path={tiny_model_dir}", f"data.source={arithmetic_jsonl}", "data.eval_source=null",
        f"trainer.output_dir={tmp_path / 'stapo'}", "trainer.total_steps=1", "trainer.train_batch_size=4",
        "trainer.mini_batch_size=2", "trainer.micro_batch_size=8", "rollout.group_size=2",
        "rollout.max_response_length=8", "logging.tensorboard=false", "logging.plot=false",
        "logging.progress=false", "trainer.export_hf=false", "inspect.record_every=0"]).to_yaml(recipe)
    assert main(["train", str(recipe)]) == 0
    stapo_run = (tmp_path / "stapo" / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert main(["train", str(recipe), "mask.name=none"]) == 2
    err = capsys.readouterr().err.strip()
    fix = f"trainer.output_dir={tmp_path / 'stapo'}-name-none"
    assert err.startswith(f"stapo train: error: trainer.output_dir {tmp_path / 'stapo'} holds step_1 of another "
                          "experiment (mask.name: 'stapo' -> 'none'"), err
    assert f"({fix}) or continue it anyway (trainer.resume=force)" in err and len(err.splitlines()) == 1
    assert (tmp_path / "stapo" / "metrics.jsonl").read_text() == stapo_run  # untouched

    assert main(["train", str(recipe), "mask.name=none", fix]) == 0
    assert "stapo: 1 steps in" in capsys.readouterr().out
    assert (tmp_path / "stapo-name-none" / "checkpoints" / "step_1").is_dir()

    assert main(["train", str(recipe), "trainer.total_steps=2"]) == 0  # more steps: the same experiment
    assert "resumed at step 1; now at step 2" in capsys.readouterr().out
