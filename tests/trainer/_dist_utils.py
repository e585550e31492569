"""Run a test function on N gloo CPU ranks, each in its own process, time-limited.

Each rank is a fresh ``python`` subprocess with the environment a launcher (torchrun, deepspeed,
accelerate) would set: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a
free ``MASTER_PORT`` — so the code under test goes through its real launcher path. The function
must be defined at module level in a file; it is called as ``fn(out_dir, **kwargs)`` and its
return value (anything ``torch.save`` can store) comes back in a list indexed by rank::

    results = run_ranks(_worker, world_size=2, tmp_path=tmp_path, kwargs={"seed": 0})

A rank that raises fails the call with its traceback; past ``timeout`` every rank is killed
(own process group each) and the call fails with the output tails.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

_BOOTSTRAP = r"""
import importlib.util, os, sys, traceback
import torch
file, qualname, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(os.environ["STAPO_TEST_RANK"])
sys.path.insert(0, os.path.dirname(file))
try:
    spec = importlib.util.spec_from_file_location("_stapo_rank_module", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kwargs = torch.load(os.path.join(out_dir, "kwargs.pt"), weights_only=False)
    result = getattr(module, qualname)(out_dir, **kwargs)
    torch.save(result, os.path.join(out_dir, f"result_rank{rank}.pt"))
except BaseException:
    with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())
    raise
# The result is on disk: skip interpreter teardown, where a loaded machine once aborted a rank
# ("terminate called without an active exception", SIGABRT) in C++ destructors after its result
# was saved; the test checks results, not teardown.
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


def rank_env(rank: int, world_size: int, port: int, launcher: bool = True) -> dict[str, str]:
    """Environment for one CPU rank (one thread: 2-core CI boxes).

    ``launcher=False`` scrubs the launcher variables: a plain ``python script.py`` process.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
               PYTHONUNBUFFERED="1", STAPO_TEST_RANK=str(rank))
    if launcher:
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # each rank leads its own session
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *, timeout: float = 120.0,
              kwargs: dict[str, Any] | None = None, launcher: bool = True) -> list[Any]:
    """Run ``fn(out_dir, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    ``launcher=False`` (``world_size=1`` only) starts a plain process with no launcher variables.
    """
    if not launcher and world_size != 1:
        raise ValueError("launcher=False runs a single plain process: use world_size=1")
    file = inspect.getfile(fn)
    out_dir = Path(tmp_path) / f"ranks_{fn.__name__}"
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(kwargs or {}, out_dir / "kwargs.pt")
    port = free_port()
    logs = [open(out_dir / f"log_rank{rank}.txt", "wb") for rank in range(world_size)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, file, fn.__qualname__, str(out_dir)],
                         env=rank_env(rank, world_size, port, launcher), stdout=logs[rank],
                         stderr=subprocess.STDOUT, start_new_session=True)
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        _kill(procs)  # no-op for ranks that exited
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(code != 0 for code in codes):
        reason = "timed out" if time.monotonic() > deadline else f"exit codes {codes}"
        details = []
        for rank in range(world_size):
            err = out_dir / f"error_rank{rank}.txt"
            text = err.read_text() if err.exists() else (out_dir / f"log_rank{rank}.txt").read_text()
            details.append(f"--- rank {rank} ---\n{text[-3000:]}")
        raise RuntimeError(f"run_ranks({fn.__name__}) {reason}\n" + "\n".join(details))
    return [torch.load(out_dir / f"result_rank{rank}.pt", weights_only=False)
            for rank in range(world_size)]


def tiny_qwen3(seed: int = 0, vocab_size: int = 64, hidden_size: int = 16, layers: int = 2):
    """A random-init Qwen3 of a few thousand parameters (eager attention: deterministic)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def gather_full_grads(engine) -> dict[str, torch.Tensor]:
    """Full (unpartitioned) fp32 gradients by HF parameter name; collective under ZeRO-3.

    Valid between the last ``backward_sum`` of a mini-batch and ``optimizer_step`` (ZeRO frees
    them at the step). Every rank must call it; every rank gets all gradients.
    """
    from deepspeed.utils import safe_get_full_grad

    from stapo.sync.buckets import hf_name

    grads = {}
    for name, param in engine.module.named_parameters():
        grad = safe_get_full_grad(param)  # all-gathers the partitions of this parameter
        if grad is not None:
            grads[hf_name(name)] = grad.detach().float().cpu().clone()
    return grads
