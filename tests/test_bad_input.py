"""What a user gets for bad input, through the real command line (a subprocess each, as a user runs it).

Every row: the exit status, no traceback on stderr, and a message that names the offending setting or
file. The fast rows stop before any model is built (the point: errors before anything heavy starts);
the slow ones train a few steps of the tiny model (a checkpoint to truncate, a run to interrupt).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.config import STAPOConfig
from stapo.run_dir import read_metrics
from stapo.telemetry.metrics import training_metrics

ROOT = Path(__file__).resolve().parents[1]

# sitecustomize that makes `import peft` fail (and find_spec report it missing): "PEFT not installed"
_BLOCK_PEFT = """import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "peft" or name.startswith("peft."):
            raise ModuleNotFoundError("No module named 'peft' (blocked by the test)")
sys.meta_path.insert(0, _Block())
"""


def _stapo(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 300):
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "STAPO_TRACEBACK"):
        full.pop(var, None)
    return subprocess.run([sys.executable, "-m", "stapo.cli", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The table's data files: good, empty, truncated, wrong columns, another format; a PEFT blocker."""
    root = tmp_path_factory.mktemp("bad_input")
    rows = [json.dumps({"prompt": f"Compute {i}+1.", "answer": str(i + 1)}) for i in range(40)]
    (root / "good.jsonl").write_text("\n".join(rows) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "truncated.jsonl").write_text("\n".join(rows[:3]) + "\n" + rows[3][:17])
    (root / "question.jsonl").write_text("\n".join(r.replace('"prompt"', '"question"') for r in rows) + "\n")
    (root / "data.csv").write_text("prompt,answer\nCompute 1+1.,2\n")
    (root / "nopeft").mkdir()
    (root / "nopeft" / "sitecustomize.py").write_text(_BLOCK_PEFT)
    return {p.stem: p for p in root.iterdir()} | {"root": root}


def _sub(value: str, files: dict[str, Path]) -> str:
    return value.format(**{k: str(v) for k, v in files.items()})


# (id, extra environment, arguments, exit status, what stderr (or stdout for a note) must name)
TABLE = [
    ("empty-file", {}, ["data.source={empty}"], 2, ["{empty}", "data.source", "empty"]),
    ("truncated-file", {}, ["data.source={truncated}"], 2, ["{truncated}", "line 4", "truncated"]),
    ("wrong-column", {}, ["data.source={question}"], 2, ["data.prompt_field", "'question'", "{question}"]),
    ("missing-file", {}, ["data.source={root}/missing.jsonl"], 2, ["{root}/missing.jsonl", "no such file"]),
    ("unsupported-format", {}, ["data.source={data}"], 2, ["{data}", "unsupported data file"]),
    ("hub-dataset-offline", {"HF_HUB_OFFLINE": "1"}, ["data.source=nobody-stapo/no-such-dataset"], 2,
     ["data.source", "nobody-stapo/no-such-dataset", "hf download"]),
    ("model-offline", {"HF_HUB_OFFLINE": "1"}, ["model.path=nobody-stapo/no-such-model"], 2,
     ["model.path", "hf download nobody-stapo/no-such-model"]),
    ("output-dir", {}, ["trainer.output_dir=/proc/stapo-cannot"], 2, ["trainer.output_dir", "/proc/stapo-cannot"]),
    ("lora-without-peft", {"PYTHONPATH": "{root}/nopeft"}, ["model.lora.enabled=true"], 2,
     ["model.lora.enabled needs PEFT"]),
    ("unknown-key", {}, ["optim.lrr=1"], 2, ["optim.lrr", "did you mean 'optim.lr'"]),
    ("wrong-type", {}, ["optim.lr=fast"], 2, ["optim.lr", "expected a number"]),
    ("unknown-mask", {}, ["mask.name=nope"], 2, ["mask.name", "unknown mask 'nope'"]),
    ("indivisible-batch", {}, ["trainer.mini_batch_size=5"], 2, ["trainer.mini_batch_size (5)"]),
    ("group-size-1", {}, ["rollout.group_size=1"], 2, ["rollout.group_size"]),
    ("override-without-value", {}, ["trainer.total_steps"], 2, ["trainer.total_steps=VALUE"]),
]


def _env(extra: dict, files) -> dict:
    env = {k: _sub(v, files) for k, v in extra.items()}
    if "PYTHONPATH" in env:  # the blocker first, then whatever made `stapo` importable here
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
@pytest.mark.parametrize("name, env, args, status, names", TABLE, ids=[row[0] for row in TABLE])
def test_bad_input_is_one_message_naming_what_is_wrong(name, env, args, status, names, dry_run, files, tmp_path):
    """``stapo train`` stops before loading anything (in seconds); ``--dry-run`` reports the same
    problem. What only this machine lacks is a note in a dry run ("not on this machine", exit 0)."""
    argv = ["train", *(_sub(a, files) for a in args)]
    if not any(a.startswith("trainer.output_dir=") for a in argv):
        argv.append(f"trainer.output_dir={tmp_path / 'run'}")
    result = _stapo(*argv, *(["--dry-run"] if dry_run else []), env=_env(env, files))
    expected = [_sub(n, files) for n in names]
    note = dry_run and name in ("hub-dataset-offline", "model-offline", "lora-without-peft")
    where = result.stdout if note else result.stderr
    assert result.returncode == (0 if note else status), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "[rank" not in result.stderr, result.stderr[-3000:]
    for part in expected:
        assert part in where, (part, where[-2000:])
    if note:
        assert "not on this machine: " in result.stdout
    else:
        assert len(result.stderr.strip().splitlines()[-1]) > 20  # one line, not a bare exception name
    assert "rollout engine:" not in result.stderr, "the error must come before anything heavy is built"


def test_help_has_no_markup():
    result = _stapo("--help")
    assert result.returncode == 0 and "``" not in result.stdout and "stapo command line" in result.stdout


# ---- rows that need a trained checkpoint: a few steps of the tiny model -------------------------------

def _config(path: Path, out: Path, model_dir, data, steps: int) -> Path:
    STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"data.eval_source={data}", f"trainer.output_dir={out}",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
        "rollout.group_size=4", "rollout.max_response_length=12", f"trainer.total_steps={steps}",
        "trainer.save_every=1", "trainer.keep_last=3", "optim.lr=1e-3", "optim.warmup_steps=2",
        "mask.params={tau_p: 0.05}", "logging.progress=false", "logging.tensorboard=false",
        "trainer.export_hf=false", "logging.plot=false",
    ]).to_yaml(path)
    return path


def _metrics(out: Path) -> dict[int, dict]:
    return {int(r["step"]): training_metrics(r) for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir, arithmetic_jsonl) -> Path:
    """An uninterrupted 4-step run: the metrics every interrupted or fallen-back run must reproduce."""
    root = tmp_path_factory.mktemp("straight")
    result = _stapo("train", str(_config(root / "c.yaml", root / "run", tiny_model_dir, arithmetic_jsonl, 4)),
                    timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_falls_back_to_the_older_one(straight, tmp_path, tiny_model_dir,
                                                                   arithmetic_jsonl):
    """The run's newest checkpoint (step_4, named by ``latest``) cut in half: ``resume=auto`` says so and
    continues from step_3 to the uninterrupted run's metrics; naming step_4 fails with the reason."""
    shutil.copytree(straight, tmp_path / "run")
    config = _config(tmp_path / "c.yaml", tmp_path / "run", tiny_model_dir, arithmetic_jsonl, 4)
    newest = tmp_path / "run" / "checkpoints" / "step_4"
    shard = next((newest / "zero").glob("*model_states.pt"))  # ZeRO-3: zero_pp_rank_0_mp_rank_00_model_states.pt
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    named = _stapo("train", str(config), f"trainer.resume={newest}")
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr[-3000:]
    assert f"trainer.resume: checkpoint {newest} cannot be resumed" in named.stderr
    assert f"{shard.name} is truncated" in named.stderr

    resumed = _stapo("train", str(config), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {newest} cannot be resumed (zero/{shard.name} is truncated" in resumed.stderr
    assert f"resuming from {newest.parent / 'step_3'} instead" in resumed.stderr
    assert "1 steps in" in resumed.stdout and "resumed at step 3" in resumed.stdout
    assert _metrics(tmp_path / "run") == _metrics(straight)


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_saves_a_checkpoint_exits_with_its_status_and_resumes_exactly(
        sig, status, straight, tmp_path, tiny_model_dir, arithmetic_jsonl):
    config = _config(tmp_path / "c.yaml", tmp_path / "run", tiny_model_dir, arithmetic_jsonl, 4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "stapo.cli", "train", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not (tmp_path / "run/checkpoints/step_1").is_dir():
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == status, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stapo train: stopped by {signal.Signals(sig).name} at step ") and "saved" in last
    stopped_at = int(last.split(" at step ")[1].split(":")[0])
    assert 1 <= stopped_at < 4 and (tmp_path / "run" / "checkpoints" / f"step_{stopped_at}").is_dir()

    resumed = _stapo("train", str(config), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{4 - stopped_at} steps in" in resumed.stdout and f"resumed at step {stopped_at}" in resumed.stdout
    assert "held-out accuracy (greedy): " in resumed.stdout  # the step-0 evaluation, read back from metrics.jsonl
    assert _metrics(tmp_path / "run") == _metrics(straight)
