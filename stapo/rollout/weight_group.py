"""The process group of one weight sync into vLLM servers, and the handshake that proves who sends.

A sync session (``rollout.mode: server``; `stapo.rollout.server_weights`) joins the trainer (rank 0,
the broadcast's source) and every server worker in a group of its own: gloo on CPU, NCCL between GPUs.
Two things keep it closed:

* **where it listens**: the trainer's TCPStore binds ``rollout.sync_host`` (a socket bound to that
  address only, handed to the store), not every interface; gloo's own sockets bind the same address
  on the trainer's side and, on a server's side, the address it reaches the trainer from;
* **who sends**: the session's random nonce travels only in the authenticated HTTP call that asks a
  server to join (`GroupSpec.nonce`); the trainer broadcasts it as the group's FIRST message, and a
  worker that receives anything else leaves the group before it loads a byte (`accept_nonce`).
  Whoever took rank 0's place in the store without the secret cannot feed a server weights.

Traffic is not encrypted: keep the weight group inside the cluster (docs/rollout.md, "Security").
Needs torch only (vLLM's worker imports it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import secrets
import socket

import torch

__all__ = ["GroupSpec", "NONCE_BYTES", "accept_nonce", "call_off", "checked_in", "let_form", "listening_store",
           "new_nonce", "route_address", "send_nonce"]

NONCE_BYTES = 16


def new_nonce() -> str:
    """A fresh session nonce (hex, ``NONCE_BYTES`` random bytes)."""
    return secrets.token_hex(NONCE_BYTES)


def route_address(peer_host: str) -> str:
    """This machine's address on the route to ``peer_host`` (a UDP ``connect`` sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer_host, 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def listening_store(host: str, timeout_s: float):
    """A TCPStore server listening on ``host`` only (port chosen by the OS): the socket is bound here and
    handed over, so the store never binds every interface; the store owns (and closes) it."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
        store = dist.TCPStore(host, listener.getsockname()[1], None, True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's now
    return store


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Where and how a server's workers join the trainer's weight group for one session.

    Rank 0 is the trainer (the broadcast's source, hosting the TCPStore at ``host:port``); a server's
    workers take ranks ``rank_offset + worker rank``. JSON-able: it crosses vLLM's ``/collective_rpc``.
    ``nonce``: the session's secret (module docstring).
    """

    host: str
    port: int
    world_size: int
    rank_offset: int = 0
    backend: str = "gloo"  # gloo (CPU tensors) or nccl (GPU tensors)
    timeout_s: float = 300.0
    nonce: str = ""
    join_timeout_s: float = 30.0  # how long a worker that checked in waits for the trainer's go

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-transfer backend must be gloo or nccl, got {self.backend!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GroupSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) - fields:
            raise ValueError(f"not a weight-group spec: {text[:200]!r}")
        return cls(**data)

    def store(self):
        """A client of the session's store (a worker's side). It connects within ``join_timeout_s``: a
        trainer gone before the worker got there must not keep the worker (and its server) waiting longer."""
        import torch.distributed as dist

        return dist.TCPStore(self.host, self.port, None, False,
                             timeout=datetime.timedelta(seconds=min(self.join_timeout_s, self.timeout_s)))

    def join(self, rank: int):
        """A worker's side of the session's two-step join: check in on the store, wait for the trainer's
        go (PermissionError if it called the session off, or gave none within ``join_timeout_s``), then
        form the group."""
        store = self.store()
        store.set(f"{_READY}{rank}", "1")
        try:
            store.wait([_GO], datetime.timedelta(seconds=self.join_timeout_s))
        except RuntimeError:  # (a timeout, or the trainer's store gone)
            raise PermissionError("the trainer gave no go for the weight group: session called off") from None
        if store.get(_GO) != b"form":
            raise PermissionError("the trainer called the weight sync off before the group formed")
        return self.connect(rank, store=store)

    def connect(self, rank: int, store=None, bind_host: str | None = None):
        """This process's member of the group (a torch ``ProcessGroupGloo`` / ``ProcessGroupNCCL``);
        rank 0 passes the store it hosts, the others connect to it. gloo's sockets bind ``bind_host``
        (default: this machine's address on the route to the store)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        if store is None:
            store = self.store()
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, self.world_size)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host or route_address(self.host))]
        return dist.ProcessGroupGloo(store, rank, self.world_size, options)


_READY, _GO = "stapo/ready/", "stapo/go"


def checked_in(store, first_rank: int, count: int) -> bool:
    """The trainer's side: have ranks ``first_rank`` .. ``first_rank + count - 1`` checked in?"""
    return store.check([f"{_READY}{r}" for r in range(first_rank, first_rank + count)])


def let_form(store) -> None:
    """Every worker checked in: let them form the group."""
    store.set(_GO, "form")


def call_off(store) -> None:
    """Not every worker checked in: the ones waiting return at once, no group forms."""
    store.set(_GO, "off")


def _nonce_tensor(nonce: str, device) -> torch.Tensor:
    raw = bytes.fromhex(nonce) if nonce else b""
    if len(raw) != NONCE_BYTES:
        raise ValueError(f"a session nonce is {NONCE_BYTES} bytes as hex, got {nonce!r}")
    return torch.tensor(list(raw), dtype=torch.uint8, device=device)


def send_nonce(group, nonce: str, device) -> None:
    """Rank 0: the session's first broadcast (`accept_nonce` on the workers)."""
    group.broadcast(_nonce_tensor(nonce, device), 0).wait()


def accept_nonce(group, nonce: str, device) -> None:
    """A worker: receive the first broadcast and check it is the nonce its authenticated join carried;
    PermissionError otherwise (the caller leaves the group, nothing loaded)."""
    expected = _nonce_tensor(nonce, device)
    got = torch.empty_like(expected)
    group.broadcast(got, 0).wait()
    if not secrets.compare_digest(bytes(got.cpu().tolist()), bytes(expected.cpu().tolist())):
        raise PermissionError("the weight group's first message is not this session's nonce: the sender is "
                              "not the trainer that opened the session; left the group, nothing loaded")
