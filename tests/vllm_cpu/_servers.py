"""Real vLLM server processes for the lane (`stapo serve`, vLLM's CPU build), on loopback only."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import LANE_TOKEN, ROOT, plain_env

START_TIMEOUT_S = 900  # a cold start on a busy 2-core machine; ~30 s on a quiet one
_NEXT_CORE = itertools.count()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """``stapo serve MODEL`` on 127.0.0.1:PORT in its own process group (vLLM starts child processes).

    Each server's worker is bound to a core of its own, in turn (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's
    automatic binding puts every server of a 2-core machine on core 0, where an idle worker's busy-polling
    of its queue starved the other's OpenMP threads — an engine step stalled for minutes, until vLLM's
    watchdog killed the engine or the idle server went away."""

    def __init__(self, model_dir: Path, log_path: Path, port: int | None = None, dtype: str = "float32",
                 args: tuple[str, ...] = (), **env: str) -> None:
        self.model_dir, self.log_path, self.dtype, self.args, self.env = model_dir, log_path, dtype, args, env
        self.port = port or free_port()
        self.core = next(_NEXT_CORE) % len(os.sched_getaffinity(0))
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "VLLMServer":
        cmd = [sys.executable, "-m", "stapo.cli", "serve", str(self.model_dir),  # loopback: stapo serve's default
               "--port", str(self.port), "--dtype", self.dtype, "--max-model-len", "512", "--seed", "0", *self.args]
        log = self.log_path.open("ab")
        env = plain_env(VLLM_CPU_OMP_THREADS_BIND=str(self.core), **self.env)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "VLLMServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.address} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=5):
                    return self
            except OSError:
                time.sleep(1.0)
        raise TimeoutError(f"server {self.address} not up after {timeout_s} s:\n{self.log_tail()}")

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=5):
                return True
        except OSError:
            return False

    def ensure_running(self) -> "VLLMServer":
        """Start the server unless it answers already (a test may run without the one that killed it)."""
        return self if self.answers() else self.start().wait_ready()

    def kill(self) -> set[Path]:
        """SIGKILL the server and its children: what a crashed node looks like to the trainer."""
        return self._end(signal.SIGKILL, 60)

    def stop(self, timeout_s: float = 60) -> set[Path]:
        """SIGTERM, as a user stops a server (SIGKILL if any of it is left after ``timeout_s``)."""
        return self._end(signal.SIGTERM, timeout_s)

    def _end(self, sig: int, timeout_s: float) -> set[Path]:
        """Signal the server, wait until no process of its group is left, then unlink the shared memory the group
        had mapped, and return it: vLLM unlinks it only on a clean exit, and every SIGKILLed server left its two
        ring buffers (psm_*, 160 and 240 MiB of address space each) in /dev/shm, ~40 names a lane run; a SIGTERMed
        one unlinks its own, but not always before its leader exits. (A semaphore name that no process maps any
        more, 32 bytes, cannot be told from the other server's and is left.)"""
        if self.proc is None:
            return set()
        pgid = self.proc.pid
        leader_gone = self.proc.poll() is not None
        if leader_gone and not _group_members(pgid):
            return set()
        segments = _shared_memory_of_group(pgid)
        if sig == signal.SIGKILL or leader_gone:  # (a leader that exited first leaves its engine process behind)
            os.killpg(pgid, sig)
        else:
            self.proc.send_signal(sig)
        if not _wait_group_gone(self.proc, timeout_s):
            os.killpg(pgid, signal.SIGKILL)
            _wait_group_gone(self.proc, 60)
        for path in segments:
            path.unlink(missing_ok=True)
        return segments

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server and its children (SIGSTOP: a hung node; SIGCONT: it wakes up)."""
        os.killpg(self.proc.pid, sig)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def _group_members(pgid: int) -> list[Path]:
    """/proc/PID of every process of group ``pgid`` that is not a zombie."""
    members = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            state, _, group = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if int(group) == pgid and state != "Z":
            members.append(proc_dir)
    return members


def _shared_memory_of_group(pgid: int) -> set[Path]:
    """The /dev/shm files the live processes of group ``pgid`` have mapped (their /proc/PID/maps)."""
    mapped = set()
    for proc_dir in _group_members(pgid):
        try:
            maps = (proc_dir / "maps").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                mapped.add(Path(fields[5].removesuffix(" (deleted)")))
    return mapped


def _wait_group_gone(leader: subprocess.Popen, timeout_s: float) -> bool:
    """Reap ``leader`` and wait until no live process of its group is left; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if leader.poll() is not None and not _group_members(leader.pid):
            return True
        time.sleep(0.2)
    return False


def lane_token_file(directory: Path) -> Path:
    """A file holding the lane's secret (mode 0600), for ``rollout.server.token_file``."""
    path = directory / "server_token"
    path.write_text(LANE_TOKEN + "\n")
    path.chmod(0o600)
    return path


def servers_override(*servers: VLLMServer) -> str:
    """The ``rollout.server.addresses`` override naming ``servers``."""
    return f"rollout.server.addresses=[{','.join(s.address for s in servers)}]"
