"""Two gloo ranks decide together (stapo.trainer.rollouts): when one rank runs out of rollout servers,
or rank 0's weight sync into them fails, EVERY rank raises NoRolloutServers at the same point — so all
enter the stop checkpoint's collective together instead of one hanging there (issue: ranks deciding
"server down" alone). The engines are stand-ins that fail on cue; the decision code is the trainer's."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, TIMEOUT_S = 2, 120


def scripted_engine(rank: int, lose_on_rank: int | None, sync_ok: bool):
    """A rollout engine that loses its servers on ``lose_on_rank`` and whose syncs report ``sync_ok``."""
    from stapo.rollout import RolloutEngine, Segment
    from stapo.servers.engine import SyncOutcome
    from stapo.servers.pool import NoRolloutServers

    class ScriptedEngine(RolloutEngine):
        def __init__(self) -> None:
            self.last_sync = SyncOutcome(sync_ok, None if sync_ok else "the join was refused", live=0)
            self.loaded = 0

        def generate_segments(self, requests, sampling):
            if rank == lose_on_rank:
                raise NoRolloutServers("no rollout server is left: 127.0.0.1:1: gone")
            return [Segment([], [], "", "error") for _ in requests]

        @contextlib.contextmanager
        def weight_update(self, version=None):
            yield

        def load_weights(self, bucket):
            self.loaded += 1

    return ScriptedEngine()


def _rank(rank: int, port: int, case: str, out) -> None:
    from stapo.config import STAPOConfig
    from stapo.distributed.process_group import DistInfo
    from stapo.servers.pool import NoRolloutServers
    from stapo.trainer.rollouts import Rollouts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cfg = STAPOConfig.from_yaml(None, ["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:1]", "rollout.server.sync_retries=1"])
    engine = scripted_engine(rank, lose_on_rank=1 if case == "generate" else None, sync_ok=case != "sync")
    rollouts = Rollouts(cfg, DistInfo(rank, WORLD, rank, torch.device("cpu")), engine, torch.nn.Linear(2, 2),
                        sampler=None, train_data=None, score=None, reward_terms=None)
    example = SimpleNamespace(prompt_ids=[1, 2], ground_truth="3", prompt_text="1+2")
    try:
        if case == "generate":
            rollouts.generate([example], step=0)
        else:
            rollouts.sync(1)
        out.put((rank, "returned", engine.loaded))
    except NoRolloutServers as err:
        out.put((rank, str(err), engine.loaded))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["generate", "sync"])
def test_every_rank_stops_together(case):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, case, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    results = sorted(out.get(timeout=max(deadline - time.monotonic(), 1)) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=30)
    if case == "generate":  # rank 1 lost its servers; rank 0 learns it in the same collective
        assert [r[1] for r in results] == ["rank 1: no rollout server is left: 127.0.0.1:1: gone"] * 2
    else:  # rank 0's sync failed twice (sync_retries=1) with no server left: both ranks stop after the first
        assert all("the weight sync into the rollout servers failed 1 time(s): the join was refused" in r[1]
                   for r in results)
        assert results[0][2] == results[1][2] == 1  # one attempt of one bucket, on both ranks in step
