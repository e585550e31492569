"""health.on_alarm=rollback on a real collapse (docs/health.md): a learning-rate spike injected by
tests/trainer/_collapse_hook.py wrecks the tiny policy, the monitors raise an alarm, and the run restores
the newest healthy checkpoint from before the onset, lowers the lr, skips the failed stretch's batches
and finishes. A SIGKILL inside the rollback (after the restore, before anything is saved) and a plain
rerun give the uninterrupted run's metrics, row for row (the pattern of test_resume.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stapo.cli import main
from stapo.config import STAPOConfig
from stapo.run_dir import read_metrics
from stapo.telemetry.metrics import training_metrics

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
HOOK = HERE / "_collapse_hook.py"
SPIKE_STEP = 6  # iteration 6 runs at 3000x the lr: step 7's rollouts come from a collapsed policy


def _config(path: Path, out: Path, model_dir, data, *extra: str) -> Path:
    STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"trainer.output_dir={out}",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
        "rollout.group_size=4", "rollout.max_response_length=12", "trainer.total_steps=10",
        "trainer.save_every=2", "trainer.keep_last=1", "optim.lr=1e-3", "optim.warmup_steps=0",
        "mask.params={tau_p: 0.05}", "logging.progress=false", "logging.tensorboard=false",
        "trainer.export_hf=false", "logging.plot=false", "logging.log_samples_every=0",
        f"reward.function={HERE / '_rewards.py'}:digit_one_reward",
        "health.on_alarm=rollback", "health.window=10", "health.warmup=3", "health.patience=2",
        "health.rollback_lr_scale=0.5", "health.keep_healthy=2", *extra,
    ]).to_yaml(path)
    return path


def _train(config: Path, *, kill_in_rollback: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAPO_TEST_SPIKE_STEP": str(SPIKE_STEP),
           "STAPO_TEST_KILL_IN_ROLLBACK": "1" if kill_in_rollback else "0"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "stapo.cli", "train", str(config), "--import", str(HOOK)],
                          env=env, capture_output=True, text=True, timeout=400)


def _model_states(checkpoint: Path) -> dict[str, torch.Tensor]:
    (states,) = sorted((checkpoint / "zero").glob("*model_states.pt"))
    return torch.load(states, weights_only=False, map_location="cpu")["module"]


def test_a_collapse_is_rolled_back_and_a_kill_mid_rollback_resumes_exactly(tmp_path, tiny_model_dir,
                                                                            arithmetic_jsonl, capsys):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = _train(_config(tmp_path / "a.yaml", straight, tiny_model_dir, arithmetic_jsonl))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(straight / "metrics.jsonl")
    alarms = [r for r in rows if r.get("event") == "alarm"]
    (rollback,) = [r for r in rows if r.get("event") == "rollback"]
    assert alarms and {a["action"] for a in alarms} == {"rollback"} and "entropy_collapse" in rollback["monitors"]
    # the spike's update is step 6: step 7's rollouts are the first sick ones, the alarm comes 2 steps in
    assert rollback["onset"] == SPIKE_STEP + 1 and rollback["step"] == SPIKE_STEP + 2
    # step_6 was saved while quiet but its weights produced the onset: the newest healthy one is step_4
    assert rollback["restored_step"] == 4 and rollback["skipped_batches"] == 4
    assert "health monitor entropy_collapse at step 8" in done.stderr and "rollback 1 of 3 at step 8" in done.stderr
    steps = {int(r["step"]): r for r in rows if "loss" in r}
    assert sorted(steps) == list(range(1, 11))  # the iterations go on to trainer.total_steps
    assert steps[9]["lr"] == pytest.approx(0.5e-3) and steps[5]["lr"] == pytest.approx(1e-3)
    assert steps[8]["entropy_mean"] < 0.5 * steps[5]["entropy_mean"]  # collapsed ...
    assert steps[9]["entropy_mean"] == pytest.approx(steps[5]["entropy_mean"], rel=0.01)  # ... and restored
    # keep_last=1, but the healthy checkpoints survive pruning: step_4, and step_8 saved right after the
    # rollback, which holds step_4's weights
    restored = _model_states(straight / "checkpoints" / "step_8")
    healthy = _model_states(straight / "checkpoints" / "step_4")
    assert restored.keys() == healthy.keys() and all(torch.equal(restored[k], healthy[k]) for k in healthy)
    assert not (straight / "checkpoints" / "step_6").exists()  # saved while quiet, not healthy: pruned

    assert main(["health", str(straight)]) == 0  # the timeline of this recorded run
    table = capsys.readouterr().out
    assert "ALARM entropy_collapse (onset 7) -> rollback" in table and "ROLLBACK to step 4, lr 0.0005" in table
    assert (straight / "health.png").is_file()

    config = _config(tmp_path / "b.yaml", killed, tiny_model_dir, arithmetic_jsonl)
    died = _train(config, kill_in_rollback=True)
    assert died.returncode == -9, died.stderr[-3000:]
    resumed = _train(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = [training_metrics(r) for r in rows]
    got = [training_metrics(r) for r in read_metrics(killed / "metrics.jsonl")]
    assert [r for r in got if "event" in r and r["event"] != "health"] == \
        [r for r in want if "event" in r and r["event"] != "health"]
    want_steps = {int(r["step"]): r for r in want if "loss" in r}
    got_steps = {int(r["step"]): r for r in got if "loss" in r}
    assert got_steps.keys() == want_steps.keys()
    for step, row in want_steps.items():
        for key, value in row.items():
            assert got_steps[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


def test_stop_saves_a_checkpoint_exits_with_status_3_and_the_same_command_resumes(tmp_path, tiny_model_dir,
                                                                                 arithmetic_jsonl):
    out = tmp_path / "run"
    config = _config(tmp_path / "c.yaml", out, tiny_model_dir, arithmetic_jsonl, "health.on_alarm=stop",
                     "trainer.total_steps=9")
    stopped = _train(config)
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert "stapo train: stopped by health alarm (entropy_collapse" in stopped.stderr
    assert f"checkpoint {out / 'checkpoints' / 'step_8'} saved; run the same command to resume" in stopped.stderr
    events = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") in ("alarm", "stop")]
    assert [(e["event"], e["step"]) for e in events][-1] == ("stop", 8)
    assert {e["action"] for e in events if e["event"] == "alarm"} == {"stop"}
    resumed = _train(config)  # the alarm stays raised while the entropy stays down: no second stop
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 8" in resumed.stderr
    steps = [int(r["step"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 10))
