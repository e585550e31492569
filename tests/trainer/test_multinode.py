"""Two nodes simulated on this machine (docs/distributed.md, "Several nodes"): two ``torchrun --nnodes 2
--nproc_per_node 1 --node_rank {0,1}`` launchers meet at ``127.0.0.1`` over gloo and run the real
``stapo train`` command, each node with its own stapo cache. A run stopped on both nodes (SIGTERM to
the launchers, as ``scancel`` does) after a checkpoint and relaunched logs the same per-step metrics as
an uninterrupted 2-node run; an ``output_dir`` that the nodes do not share (node 1 given its own) stops
both nodes with one clear line before anything is written. The shared-directory check itself is also
tested on two plain ranks (``run_ranks``).

:func:`start_nodes` is the launcher of the 2-node tests: other multi-node tests pass their own overrides.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest
from _dist_utils import _kill, free_port, rank_env, run_ranks
from test_resume import COMPARED, _by_step, _write_config

from stapo.run_dir import CHECKPOINT_DIR, latest_checkpoint, step_of

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

NODES = 2
REWARD = f"{Path(__file__).with_name('_rewards.py')}:digit_one_reward"  # mixed rewards from a random model
STEPS = 3


def start_nodes(config: Path, logs: Path, overrides: Sequence[str] = (),
                node_overrides: Sequence[Sequence[str]] = ((), ())) -> list[subprocess.Popen]:
    """``torchrun ... -m stapo.cli train CONFIG *overrides *node_overrides[n]`` for node 0 and node 1.

    Each launcher leads its own session and writes its console to ``logs/node<n>.txt``; its rank's own
    stdout/stderr go to ``logs/node<n>/`` (torchrun ``--redirects``). Each node has its own stapo cache,
    ``logs/node<n>_cache`` (``STAPO_CACHE``), as on nodes with local disks."""
    port = free_port()
    procs = []
    for node in range(NODES):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", "--nproc_per_node=1",
                   f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                   f"--log_dir={logs / f'node{node}'}", "--redirects=3",
                   "-m", "stapo.cli", "train", str(config), *overrides, *node_overrides[node]]
        env = {**rank_env(node, NODES, port, launcher=False), "STAPO_CACHE": str(logs / f"node{node}_cache")}
        with open(logs / f"node{node}.txt", "wb") as console:
            procs.append(subprocess.Popen(command, env=env, stdout=console, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def rank_output(logs: Path, node: int) -> str:
    """What the rank on ``node`` printed (stdout then stderr; one rank per node)."""
    files = sorted((logs / f"node{node}").rglob("std*.log"), key=lambda p: p.name != "stdout.log")
    return "".join(p.read_text(errors="replace") for p in files)


def stop_nodes(procs: list[subprocess.Popen], grace: float = 30) -> None:
    """SIGTERM to each launcher, as ``scancel`` does: torchrun passes it to its rank (which it started in
    a session of its own, out of reach of a signal to the launcher's group) and exits once the rank
    is gone. A launcher still there after ``grace`` seconds is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill(procs)


def wait_nodes(procs: list[subprocess.Popen], logs: Path, timeout: float = 300) -> list[int]:
    """Both launchers' exit codes; past ``timeout`` both are stopped and the test fails with their output."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    timed_out = any(p.poll() is None for p in procs)
    stop_nodes(procs)
    if timed_out:
        pytest.fail("2-node run timed out\n" + _tails(logs))
    return [p.returncode for p in procs]


def _tails(logs: Path) -> str:
    return "\n".join(f"--- node {n} ---\n{(logs / f'node{n}.txt').read_text(errors='replace')[-2000:]}\n"
                     f"{rank_output(logs, n)[-3000:]}" for n in range(NODES))


def _run(config: Path, logs: Path, overrides: Sequence[str] = ()) -> None:
    logs.mkdir(parents=True)
    codes = wait_nodes(start_nodes(config, logs, overrides), logs)
    assert codes == [0] * NODES, f"exit codes {codes}\n" + _tails(logs)


@pytest.fixture
def two_node_config(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """``write(name)``: test_resume's run config (a checkpoint every step) with output_dir ``tmp_path/name``."""
    def write(name: str) -> Path:
        return _write_config(tmp_path / f"{name}.yaml", tmp_path / name, tiny_model_dir, arithmetic_jsonl)
    return write


def test_two_nodes_train_checkpoint_and_resume_like_an_uninterrupted_run(tmp_path, two_node_config):
    overrides = [f"trainer.total_steps={STEPS}", f"reward.function={REWARD}",
                 "model.path=builtin:tiny", "tiny.warm_start_steps=0"]  # built by each node into its own cache
    _run(two_node_config("straight"), tmp_path / "logs_straight", overrides)
    for node in range(NODES):
        assert len(list((tmp_path / "logs_straight" / f"node{node}_cache" / "tiny").glob("model-*"))) == 1
    last = latest_checkpoint(tmp_path / "straight")  # rank 0 renamed it with both nodes' ZeRO shards inside
    assert last.name == f"step_{STEPS}" and json.loads((last / "meta.json").read_text())["world_size"] == NODES
    assert sorted(p.name for p in (last / "zero").glob("*optim_states.pt")) == [
        f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(NODES)]

    config, killed, logs = two_node_config("killed"), tmp_path / "killed", tmp_path / "logs_killed"
    logs.mkdir()
    procs = start_nodes(config, logs, overrides)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if latest_checkpoint(killed) is not None:
            break
        time.sleep(0.02)
    alive = all(p.poll() is None for p in procs)
    stop_nodes(procs)  # both nodes stopped mid-run (their ranks die on SIGTERM: no checkpoint on the way out)
    assert alive and latest_checkpoint(killed) is not None, "no checkpoint while both nodes ran\n" + _tails(logs)
    assert all(p.returncode != 0 for p in procs)
    resumed_from = step_of(latest_checkpoint(killed))
    assert 1 <= resumed_from < STEPS

    _run(config, tmp_path / "logs_resumed", overrides)  # trainer.resume: auto (the default), both nodes
    for node in range(NODES):  # every rank continued from the checkpoint rank 0 picked
        assert f"resumed from {killed / CHECKPOINT_DIR}/step_{resumed_from} at step {resumed_from}" in \
            rank_output(tmp_path / "logs_resumed", node)
    expected, got = _by_step(tmp_path / "straight"), _by_step(killed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert any(row["grad_norm"] > 0 for row in expected.values())  # the policy was updated: a real comparison
    for step in range(1, STEPS + 1):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_node_local_output_dir_is_refused_on_every_node(tmp_path, two_node_config):
    config, node1_dir, logs = two_node_config("run"), tmp_path / "node1_run", tmp_path / "logs"
    logs.mkdir()
    codes = wait_nodes(start_nodes(config, logs, node_overrides=((), (f"trainer.output_dir={node1_dir}",))), logs)
    assert all(code != 0 for code in codes), f"exit codes {codes}\n" + _tails(logs)
    for node, out in enumerate((tmp_path / "run", node1_dir)):
        said = rank_output(logs, node)
        assert f"stapo train: error: trainer.output_dir {out} must be a directory on a filesystem all nodes share" \
               in said, said[-3000:]
        assert "rank 1 on " in said  # names the rank that cannot see rank 0's probe
        assert "Traceback" not in said, said[-3000:]
        assert list(out.iterdir()) == []  # refused before any file is written; the probe is gone


def _probe(out_dir, shared: str, own: list[str], blocked: str) -> dict:
    """``require_shared_dir`` on this rank: a shared directory, one directory per rank, a path rank 0
    cannot create (a file); what each raised (None: passed)."""
    from stapo.distributed.process_group import barrier, get_rank, init_distributed
    from stapo.distributed.shared_dir import NotSharedError, require_shared_dir

    init_distributed()
    said = {}
    for case, path in (("shared", shared), ("own", own[get_rank()]), ("blocked", blocked)):
        try:
            require_shared_dir(path, name="trainer.output_dir", wait_s=0.5)
            said[case] = None
        except NotSharedError as err:
            said[case] = str(err)
    barrier()
    said["left_in_shared"] = sorted(p.name for p in Path(shared).iterdir())
    return said


def test_require_shared_dir_passes_a_shared_dir_and_stops_every_rank_otherwise(tmp_path):
    own = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    (tmp_path / "a_file").write_text("not a directory")
    views = run_ranks(_probe, world_size=2, tmp_path=tmp_path, kwargs={
        "shared": str(tmp_path / "shared"), "own": own, "blocked": str(tmp_path / "a_file")})
    for rank, said in enumerate(views):  # every rank gets the verdict: none is left waiting in a collective
        assert said["shared"] is None
        assert said["left_in_shared"] == []  # the probe is deleted
        assert said["own"].startswith(f"trainer.output_dir {own[rank]} must be a directory on a filesystem all "
                                      "nodes share")  # each rank names the path it was given
        assert "rank 1 on " in said["own"] and "rank 0 on " not in said["own"]
        assert "no probe file (FileNotFoundError)" in said["own"]
        assert said["blocked"].startswith(f"trainer.output_dir {tmp_path / 'a_file'} must be")
        assert "rank 0 cannot write there" in said["blocked"] and "rank 1 on " not in said["blocked"]
