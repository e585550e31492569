"""The trainer's side of a weight sync into vLLM servers: one session, buckets by broadcast.

A session (``rollout.mode: server``; docs/rollout.md, "Rollout servers") is the colocated engine's
session — begin, one load per bucket, finish — carried over the network:

1. the trainer (global rank 0) hosts a TCPStore and asks every live server, over its
   ``/collective_rpc`` route, to join a process group for this session (`GroupSpec`): rank 0 is the
   trainer, each server's workers follow (a tensor-parallel server's workers each receive the full
   tensors; vLLM's ``load_weights`` shards them); joining also begins the server's layerwise reload;
2. per bucket, the layout goes as JSON in an RPC and the bytes by ONE ``broadcast`` from rank 0:
   NCCL between GPUs, gloo on CPU — the same session, bucket splitting and tied-head handling, so
   vLLM's CPU build runs it in CI;
3. finish processes the layers still waiting, records the policy version the server now holds, and
   drops the prefix cache (its KV entries came from the old weights).

vLLM's own weight-transfer engines (``/init_weight_transfer_engine``) offer NCCL and CUDA IPC only,
which a CPU machine cannot run; a group per session also lets a restarted server join the next sync.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from stapo.rollout.server_client import ServerClient, ServerError
from stapo.rollout.vllm_worker import GroupSpec, pack_bucket_tensor

__all__ = ["BroadcastSession", "reachable_address", "transfer_backend"]


def transfer_backend() -> str:
    """``nccl`` where the trainer has a GPU (the servers' workers then receive on theirs), else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def reachable_address(server_host: str) -> str:
    """This machine's address on the route to ``server_host`` (a UDP ``connect`` sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((server_host, 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class BroadcastSession:
    """One weight-update session from the trainer into ``servers`` (each: a client and its worker count)."""

    def __init__(self, servers: Sequence[tuple[ServerClient, int]], timeout_s: float = 600.0,
                 backend: str | None = None) -> None:
        if not servers:
            raise ValueError("a weight-update session needs at least one server")
        self.servers = list(servers)
        self.backend = backend or transfer_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="stapo-sync")
        self._group = None
        self._store = None

    def open(self) -> None:
        """Create this session's group (rank 0 here) and begin the update on every server."""
        import datetime

        import torch.distributed as dist

        host = reachable_address(self.servers[0][0].host)
        world = 1 + sum(workers for _, workers in self.servers)
        self._store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                                    wait_for_workers=False)
        offsets, offset = [], 1
        for _, workers in self.servers:
            offsets.append(offset)
            offset += workers
        specs = [GroupSpec(host, self._store.port, world, rank_offset=o, backend=self.backend,
                           timeout_s=self.timeout_s) for o in offsets]
        joins = self._on_every_server("stapo_join_weight_group", [s.to_json() for s in specs])
        self._group = specs[0].connect(0, store=self._store)  # returns once every worker has joined
        self._wait(joins)

    def send(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket to every server (each loads it inside its open session)."""
        layout, flat = pack_bucket_tensor(list(bucket))
        receives = self._on_every_server("stapo_receive_bucket", [json.dumps(layout)] * len(self.servers))
        self._group.broadcast(flat.to(self.device), 0).wait()
        counts = self._wait(receives)
        expected = len(layout["names"])
        for (client, _), results in zip(self.servers, counts):
            if any(int(r) != expected for r in results):
                raise ServerError(client.address, f"loaded {results} tensors of a {expected}-tensor bucket")

    def close(self, version: int | None) -> None:
        """Finish the session on every server: it then holds policy ``version``."""
        try:
            self._wait(self._on_every_server("stapo_finish_weight_update", [str(version)] * len(self.servers)))
            for client, _ in self.servers:
                client.post("/reset_prefix_cache", {}, self.timeout_s)
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the session's group and threads (after a failure; `close` ends with it too)."""
        self._group = self._store = None
        self._pool.shutdown(wait=False)

    def _on_every_server(self, method: str, args: list[str]) -> list:
        return [self._pool.submit(client.rpc, method, arg, timeout_s=self.timeout_s)
                for (client, _), arg in zip(self.servers, args)]

    @staticmethod
    def _wait(futures: list) -> list:
        return [f.result() for f in futures]
