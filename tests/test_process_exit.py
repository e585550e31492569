"""How a finished ``stapo`` process ends: with its command's status, after its ``atexit`` handlers and with
its buffered output flushed, but without the interpreter's C++ teardown (where gloo's threads once turned
a finished 2-rank ``stapo eval`` into status -6)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_exit_process_keeps_the_status_runs_atexit_handlers_and_flushes(tmp_path):
    done = _python("""
        import atexit, pathlib, sys
        from stapo.distributed.process_group import exit_process, init_distributed
        init_distributed()  # a one-rank gloo group, as every trainer makes
        atexit.register(lambda: pathlib.Path("atexit-ran").write_text("yes"))
        sys.stdout.write("buffered, no newline")
        exit_process(0)
        """, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.endswith("buffered, no newline")  # DeepSpeed prints its own lines first
    assert (tmp_path / "atexit-ran").read_text() == "yes"


def test_a_failed_command_keeps_its_own_status(tmp_path):
    done = _python("""
        from stapo.distributed.process_group import exit_process, init_distributed
        init_distributed()
        exit_process(3)  # e.g. health.on_alarm=stop
        """, tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]


def test_the_stapo_command_returns_main_s_status(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "stapo.cli", "train", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr
    listed = subprocess.run([sys.executable, "-m", "stapo.cli", "masks"], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0 and "stapo" in listed.stdout
