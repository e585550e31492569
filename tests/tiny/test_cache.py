"""Cache entries copied between machines (the trainer sends rank 0's tiny model to node-local caches)."""

from pathlib import Path

import pytest

from stapo.tiny.cache import cache_root, entry_files, install_entry


def test_an_installed_entry_has_the_same_bytes_and_loads(tiny_model_dir, tmp_path, monkeypatch):
    files = entry_files(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "other_node"))  # another node's empty cache
    installed = install_entry(tiny_model_dir.name, files)
    assert installed == cache_root() / tiny_model_dir.name != tiny_model_dir
    assert entry_files(installed) == files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(installed))  # a complete model directory
    (installed / "config.json").write_text("{}")  # an entry of that name exists: reused, not rewritten
    assert install_entry(tiny_model_dir.name, files) == installed and (installed / "config.json").read_text() == "{}"


def test_only_flat_entries_are_copied(tmp_path):
    (tmp_path / "entry" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"not a flat cache entry: \['sub'\]"):
        entry_files(tmp_path / "entry")


KILLED_MID_BUILD = """
import os, signal, sys
from pathlib import Path
from stapo.tiny.cache import build_atomically

def build(tmp):
    (tmp / "half.bin").write_bytes(b"x")
    print(tmp, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # killed before any cleanup can run

build_atomically(Path(sys.argv[1]), build, reuse=True)
"""


def test_a_build_killed_midway_leaves_no_residue_after_the_next_build(tmp_path, capsys):
    import os
    import socket
    import subprocess
    import sys

    from stapo.tiny.cache import build_atomically

    final = tmp_path / "model-abc"
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_BUILD, str(final)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert killed.returncode == -9
    orphan = Path(killed.stdout.strip())
    assert orphan.parent == tmp_path and orphan.is_dir() and not final.exists()
    live = tmp_path / f".model-abc.tmp-{socket.gethostname()}-{os.getpid()}-live"  # a build still running here
    elsewhere = tmp_path / ".model-abc.tmp-another-host-1-x"  # a node sharing the cache: its pids are not ours
    live.mkdir()
    elsewhere.mkdir()

    built = build_atomically(final, lambda tmp: (tmp / "ok").write_text("1"), reuse=True)

    assert (built / "ok").read_text() == "1"
    assert not orphan.exists() and live.is_dir() and elsewhere.is_dir()
    # the killed builder held the entry's lock: the kernel dropped it (this build did not wait), this one removed it
    assert "waiting" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, live.name, elsewhere.name])


SLOW_BUILD = """
import sys, time
from pathlib import Path
from stapo.tiny.cache import build_atomically

def build(tmp):
    with open(sys.argv[2], "a") as builds:
        builds.write("built\\n")
    print("building", flush=True)
    time.sleep(float(sys.argv[3]))
    if sys.argv[4:] == ["fail"]:
        raise SystemExit("build failed")
    (tmp / "weights").write_text(str(len(Path(sys.argv[2]).read_text().split())))

print("ready", flush=True)  # imported (seconds under load): the build starts on the test's word
sys.stdin.readline()
print(build_atomically(Path(sys.argv[1]), build, reuse=True), flush=True)
"""


def _builder(final: Path, builds: Path, seconds: float, *how: str):
    """A process building ``final`` with SLOW_BUILD, imported and waiting for the word to start."""
    import os
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(final), str(builds), str(seconds), *how],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert process.stdout.readline() == "ready\n", process.communicate(timeout=120)
    return process


def _start(process) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()


def test_two_processes_wanting_one_entry_build_it_once(tmp_path):
    final, builds = tmp_path / "warm-abc", tmp_path / "builds.txt"
    first, second = _builder(final, builds, 3), _builder(final, builds, 0)
    _start(first)
    assert first.stdout.readline() == "building\n"  # it holds the lock now, for 3 s
    _start(second)
    (out, err), (second_out, second_err) = first.communicate(timeout=120), second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, (err, second_err)
    assert builds.read_text() == "built\n"  # once, by the first
    assert out.split()[-1] == second_out.strip() == str(final) and (final / "weights").read_text() == "1"
    assert f"warm-abc: another process (pid {first.pid} on " in second_err
    assert "waiting to reuse its result" in second_err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds.txt", "warm-abc"]  # no lock file left


def test_a_process_waiting_on_a_build_that_fails_builds_the_entry_itself(tmp_path):
    final, builds = tmp_path / "warm-abc", tmp_path / "builds.txt"
    first, second = _builder(final, builds, 3, "fail"), _builder(final, builds, 0)
    _start(first)
    assert first.stdout.readline() == "building\n"
    _start(second)
    assert first.wait(timeout=120) == 1
    second_out, second_err = second.communicate(timeout=120)
    assert second.returncode == 0, second_err
    assert "waiting to reuse its result" in second_err
    assert builds.read_text() == "built\nbuilt\n" and (final / "weights").read_text() == "2"  # the second's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds.txt", "warm-abc"]


def test_a_file_system_refusing_locks_still_builds_and_says_so(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from stapo.tiny.cache import build_atomically

    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    built = build_atomically(tmp_path / "model-abc", lambda tmp: (tmp / "ok").write_text("1"), reuse=True)
    assert (built / "ok").read_text() == "1"
    assert "warning: model-abc: cannot lock" in capsys.readouterr().err
