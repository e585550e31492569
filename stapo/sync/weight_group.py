"""The process group of one weight sync into vLLM servers, and the proofs that keep strangers out of it
(docs/rollout.md, "Security": what each step holds against). A TCPStore authenticates nobody and lists its keys,
so every key a join waits for is an HMAC of the session's nonce (`proof`, `namespaced`). Torch only.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import json
import math
import secrets
import socket
from collections.abc import Sequence

import torch

__all__ = ["GroupSpec", "MAX_JOIN_TIMEOUT_S", "NONCE_BYTES", "STEP_TIMEOUT_ENV", "call_off", "checked_in",
           "exchange_proofs", "is_loopback", "let_form", "listening_store", "namespaced", "new_nonce", "proof",
           "route_address", "sync_address"]

NONCE_BYTES = 16
# vLLM's engine-step limit (default 300 s; `stapo serve` sets 900): a server ends each sync step before it
# (30 s before, or a tenth of it when that is less), since a worker in a sync step holds up the engine's next
STEP_TIMEOUT_ENV, VLLM_STEP_TIMEOUT_S, STEP_MARGIN_S = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0, 30.0
MAX_JOIN_TIMEOUT_S = 60.0  # a server waits at most this for the trainer's go, whatever a join asks


def new_nonce() -> str:
    """A fresh session nonce (hex, ``NONCE_BYTES`` random bytes)."""
    return secrets.token_hex(NONCE_BYTES)


def proof(nonce: str, label: str) -> str:
    """HMAC-SHA256 of ``label`` keyed by the session nonce (hex): only a holder of the nonce can compute it."""
    raw = bytes.fromhex(nonce) if nonce else b""
    if len(raw) != NONCE_BYTES:
        raise ValueError(f"a session nonce is {NONCE_BYTES} bytes as hex, got {len(raw)} bytes")
    return hmac.new(raw, label.encode(), hashlib.sha256).hexdigest()


def route_address(peer_host: str) -> str:
    """This machine's address on the route to ``peer_host`` (a UDP ``connect`` sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer_host, 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def sync_address(addresses: Sequence[str], configured: str | None) -> str:
    """The trainer's address for the weight group: ``rollout.server.sync_host`` resolved (a server compares it with
    its caller's), else loopback when every server is local, else the one route to the servers (or ValueError)."""
    if configured:
        try:
            return str(ipaddress.ip_address(configured.strip("[]")))
        except ValueError:
            try:
                return socket.getaddrinfo(configured, None, type=socket.SOCK_STREAM)[0][4][0]
            except OSError as err:
                raise ValueError(f"rollout.server.sync_host {configured!r} does not resolve ({err})") from None
    hosts = [a.rpartition(":")[0].strip("[]") for a in addresses]
    if all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    routes = {route_address(h) for h in hosts}
    if len(routes) > 1:
        raise ValueError(f"the rollout servers are reached through different addresses of this machine "
                         f"({sorted(routes)}): set rollout.server.sync_host to the one they all reach the trainer at")
    return routes.pop()


def listening_store(host: str, timeout_s: float):
    """A TCPStore server on ``host`` only: the socket is bound here and handed over (the store owns it), so the
    store never binds every interface."""
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


def namespaced(store, nonce: str):
    """The session's view of ``store``: every key (gloo's included) under a prefix only the nonce gives."""
    import torch.distributed as dist

    return dist.PrefixStore(proof(nonce, "store")[:32] + "/", store)


def _finite_positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"weight-group spec: {name} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Where and how a server's workers join one session's weight group (JSON: it crosses ``/collective_rpc``).
    Rank 0 is the trainer, hosting the store at ``host:port``; a server's workers take ``rank_offset + rank``."""

    host: str
    port: int
    world_size: int
    rank_offset: int = 0
    backend: str = "gloo"  # gloo (CPU tensors) or nccl (GPU tensors)
    timeout_s: float = 300.0
    nonce: str = dataclasses.field(default="", repr=False)
    join_timeout_s: float = 30.0  # how long a worker that checked in waits for the trainer's go

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-transfer backend must be gloo or nccl, got {self.backend!r}")
        ints = (("port", 1, 65535), ("world_size", 2, 1 << 20), ("rank_offset", 0, 1 << 20))
        for name, low, high in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"weight-group spec: {name} must be an integer in [{low}, {high}], got {value!r}")
        _finite_positive(self.timeout_s, "timeout_s")
        _finite_positive(self.join_timeout_s, "join_timeout_s")
        if not isinstance(self.host, str) or not isinstance(self.nonce, str):
            raise ValueError("weight-group spec: host and nonce must be strings")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GroupSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) - fields:
            raise ValueError(f"not a weight-group spec: {text[:200]!r}")
        return cls(**data)

    def bounded(self, step_timeout_s: float) -> "GroupSpec":
        """This spec within a server's own bounds, whatever the caller asked: each step ends before vLLM's
        ``step_timeout_s``, the wait for the go within ``MAX_JOIN_TIMEOUT_S``."""
        timeout = min(self.timeout_s, step_timeout_s - min(STEP_MARGIN_S, step_timeout_s / 10))
        return dataclasses.replace(self, timeout_s=timeout,
                                   join_timeout_s=min(self.join_timeout_s, timeout, MAX_JOIN_TIMEOUT_S))

    def store(self):
        """A worker's client of the session's store, `namespaced`; it connects within ``join_timeout_s`` (a trainer
        gone meanwhile must not keep the server waiting)."""
        import torch.distributed as dist

        client = dist.TCPStore(self.host, self.port, None, False,
                               timeout=datetime.timedelta(seconds=min(self.join_timeout_s, self.timeout_s)))
        return namespaced(client, self.nonce)

    def join(self, rank: int, device: torch.device):
        """A worker's side: check in, wait for the trainer's go (PermissionError if called off or none came within
        ``join_timeout_s``), form the group and prove the nonce both ways. Returns the group."""
        if not 1 <= rank < self.world_size:  # rank 0 is the trainer's
            raise ValueError(f"weight-group spec: a server's rank must be in [1, {self.world_size}), got {rank}")
        store = self.store()
        store.set(_ready_key(self.nonce, rank), "1")
        go = _go_key(self.nonce)
        try:
            store.wait([go], datetime.timedelta(seconds=self.join_timeout_s))
        except RuntimeError:  # (a timeout, or the trainer's store gone)
            raise PermissionError("the trainer gave no go for the weight group: session called off") from None
        if not hmac.compare_digest(store.get(go), proof(self.nonce, "form").encode()):
            raise PermissionError("the trainer called the weight sync off before the group formed")
        group, wrong = self.form(rank, store, device)
        if wrong:
            raise PermissionError("the weight group's rank 0 did not prove it holds this session's nonce: it is not "
                                  "the trainer that opened the session; left the group, nothing loaded")
        return group

    def form(self, rank: int, store, device, bind_host: str | None = None) -> tuple:
        """``(group, the wrong proofs this rank checks)``: `connect`, `exchange_proofs`, then the group's
        collectives get ``timeout_s``. Until then every step is bounded by ``join_timeout_s``: each member checked
        in before the go, so forming takes a moment, and a member lost meanwhile must not hold the others (a
        server's engine, blocked in the join) for a whole ``timeout_s``."""
        group = self.connect(rank, store, bind_host)
        wrong = exchange_proofs(group, self.nonce, rank, self.world_size, device)
        group._set_default_timeout(datetime.timedelta(seconds=self.timeout_s))  # torch's own _set_pg_timeout's call
        return group, wrong

    def connect(self, rank: int, store, bind_host: str | None = None):
        """This process's member of the group over the `namespaced` ``store``, its timeout the formation's bound
        (`form` lifts it); gloo's sockets bind ``bind_host`` (default: this machine's address on the route to the
        store)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=min(self.join_timeout_s, self.timeout_s))
        if self.backend == "nccl":  # as torch's own new_group builds it, with this spec's timeout (not NCCL's 10 min)
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, self.world_size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host or route_address(self.host))]
        return dist.ProcessGroupGloo(store, rank, self.world_size, options)


def _ready_key(nonce: str, rank: int) -> str:
    return "ready/" + proof(nonce, f"ready {rank}")


def _go_key(nonce: str) -> str:
    return "go/" + proof(nonce, "go")


def checked_in(store, nonce: str, first_rank: int, count: int) -> bool:
    """The trainer's side: have ranks ``first_rank`` .. ``first_rank + count - 1`` checked in?"""
    return store.check([_ready_key(nonce, r) for r in range(first_rank, first_rank + count)])


def let_form(store, nonce: str) -> None:
    """Every worker checked in: let them form the group."""
    store.set(_go_key(nonce), proof(nonce, "form"))


def call_off(store, nonce: str) -> None:
    """Not every worker checked in: the ones waiting return at once, no group forms."""
    store.set(_go_key(nonce), "off")


def exchange_proofs(group, nonce: str, rank: int, world_size: int, device) -> list[int]:
    """The group's first collective, an all-gather of every rank's proof of the nonce; returns the wrong ones among
    those this rank checks (rank 0: every member; a worker: rank 0)."""
    mine = torch.tensor(list(bytes.fromhex(proof(nonce, f"member {rank}"))), dtype=torch.uint8, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    group.allgather([everyone], [mine]).wait()
    checked = range(1, world_size) if rank == 0 else (0,)
    return [r for r in checked if not hmac.compare_digest(bytes(everyone[r].cpu().tolist()),
                                                          bytes.fromhex(proof(nonce, f"member {r}")))]
