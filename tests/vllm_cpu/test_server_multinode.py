"""Two trainer nodes (two ``torchrun --nnodes 2`` launchers on loopback, gloo) generating through one real
vLLM CPU server (docs/distributed.md, "Several nodes"): the run trains, checkpoints, is stopped, and
resumes on both nodes to the metrics of an uninterrupted 2-node run. The launchers are those of
tests/trainer/test_multinode.py; here every rank is a client of the server and rank 0 syncs it."""

from __future__ import annotations

import sys
import time

import pytest
from _bounds import assert_steps_fp32_noise
from _servers import lane_token_file, servers_override
from conftest import HERE

sys.path.insert(0, str(HERE.parent / "trainer"))
from test_multinode import NODES, REWARD, _tails, rank_output, start_nodes, stop_nodes, wait_nodes  # noqa: E402
from test_resume import COMPARED, _by_step, _write_config  # noqa: E402

from stapo.run_dir import CHECKPOINT_DIR, latest_checkpoint, step_of  # noqa: E402

pytestmark = pytest.mark.timeout(1800)
STEPS = 3


def _run(config, logs, overrides) -> None:
    logs.mkdir(parents=True)
    codes = wait_nodes(start_nodes(config, logs, overrides), logs, timeout=900)
    assert codes == [0] * NODES, f"exit codes {codes}\n" + _tails(logs)


def test_two_nodes_train_through_a_server_checkpoint_and_resume(servers, tmp_path, tiny_model_dir, arithmetic_jsonl):
    overrides = [f"trainer.total_steps={STEPS}", f"reward.function={REWARD}", "rollout.mode=server",
                 f"rollout.server.token_file={lane_token_file(tmp_path)}",  # the launchers' environment has no secret
                 servers_override(servers[0]), "model.dtype=fp32"]
    straight = _write_config(tmp_path / "straight.yaml", tmp_path / "straight", tiny_model_dir, arithmetic_jsonl)
    _run(straight, tmp_path / "logs_straight", overrides)

    killed = tmp_path / "killed"
    config, logs = _write_config(tmp_path / "killed.yaml", killed, tiny_model_dir, arithmetic_jsonl), tmp_path / "logs_k"
    logs.mkdir()
    procs = start_nodes(config, logs, overrides)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and all(p.poll() is None for p in procs) and latest_checkpoint(killed) is None:
        time.sleep(0.05)
    assert all(p.poll() is None for p in procs), "a node exited before it could be stopped\n" + _tails(logs)
    stop_nodes(procs)
    resumed_from = step_of(latest_checkpoint(killed))
    assert 1 <= resumed_from < STEPS

    _run(config, tmp_path / "logs_resumed", overrides)
    for node in range(NODES):
        assert f"resumed from {killed / CHECKPOINT_DIR}/step_{resumed_from} at step {resumed_from}" in \
            rank_output(tmp_path / "logs_resumed", node)
    expected, got = _by_step(tmp_path / "straight"), _by_step(killed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert_steps_fp32_noise([got[step] for step in sorted(got)], "2 nodes through a server")  # it holds the policy
    for step in range(1, STEPS + 1):
        assert got[step]["policy_staleness"] == 0
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)
