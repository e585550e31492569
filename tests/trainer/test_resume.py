"""Kill test (docs/distributed.md, "Resuming"): a run SIGKILLed mid-training and resumed with ``resume: auto`` logs the
same per-step metrics as an uninterrupted run with the same seed (same data order, sampling seeds,
optimizer state). That a kill *during* a checkpoint write leaves ``latest`` on the previous complete
checkpoint is tested in test_checkpoint.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.config import STAPOConfig
from stapo.run_dir import latest_checkpoint, read_metrics, step_of

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_train_run.py")
COMPARED = ("reward_mean", "accuracy", "entropy_mean", "loss", "grad_norm", "silenced_frac", "lr")


def _write_config(path: Path, out: Path, model_dir, data) -> Path:
    STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"trainer.output_dir={out}",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
        "rollout.group_size=4", "rollout.max_response_length=12", "trainer.total_steps=6",
        "trainer.save_every=1", "trainer.keep_last=2", "optim.lr=1e-3", "optim.warmup_steps=2",
        "mask.params={tau_p: 0.05}", "logging.progress=false", "logging.tensorboard=false",
        "trainer.export_hf=false", "logging.plot=false",
    ]).to_yaml(path)
    return path


def _start(config: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, str(SCRIPT), str(config)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def _by_step(out: Path) -> dict[int, dict]:
    return {int(r["step"]): r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, tiny_model_dir, arithmetic_jsonl):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _finish(_start(_write_config(tmp_path / "a.yaml", straight, tiny_model_dir, arithmetic_jsonl)))

    config = _write_config(tmp_path / "b.yaml", killed, tiny_model_dir, arithmetic_jsonl)
    proc = _start(config)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        latest = latest_checkpoint(killed)
        if latest is not None and step_of(latest) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed_from = step_of(latest_checkpoint(killed))
    assert 2 <= resumed_from < 6

    _finish(_start(config))  # resume: auto (the default)
    expected, got = _by_step(straight), _by_step(killed)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in range(1, 7):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)
