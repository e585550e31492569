"""Start a bench script's worker on N CPU ranks (gloo) with the launcher variables, collect rank 0's
``RESULT {json}`` lines. Shared by bench/weight_sync.py and bench/zero_tuning.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def launch_cpu_ranks(script: str, args: list[str], world_size: int, timeout: float, what: str) -> list[dict]:
    """Run ``python script --worker ARGS`` on ``world_size`` CPU ranks; rank 0's RESULT rows."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{what} worker failed:\n{err[-3000:]}")
    return [json.loads(line[len("RESULT "):]) for line in outputs[0][0].splitlines() if line.startswith("RESULT ")]


def exit_worker() -> None:
    """End a finished worker the way the ``stapo`` command ends (stapo.distributed.process_group.exit_process)."""
    from stapo.distributed.process_group import exit_process

    exit_process(0)
