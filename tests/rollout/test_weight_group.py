"""The weight group of a server sync (stapo.sync.weight_group) against a process that knows only the port of the
trainer's TCPStore (readable in /proc/net/tcp), a rank 0 or a receiver that does not hold the session nonce, a
join that asks a server to wait forever, and a transfer that changes bytes: the real gloo group and the real
worker side (`DictWorker`, tests/rollout/_fake_server.py), on loopback, without vLLM. Real servers:
tests/vllm_cpu/test_server_security.py."""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _fake_server import DictWorker, FakeServer
from stapo.servers.client import ServerClient
from stapo.servers.engine import ServerEngine, ServerLimits
from stapo.sync import broadcast
from stapo.sync.broadcast import BroadcastSession, SyncFailed
from stapo.sync.buckets import sync_weights
from stapo.sync.weight_group import (GroupSpec, checked_in, exchange_proofs, let_form, listening_store, namespaced,
                                       new_nonce)

CPU = torch.device("cpu")
LIMITS = ServerLimits(request_retries=0, health_interval_s=0.2, health_timeout_s=2.0, sync_timeout_s=20.0)


def policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))


def holds(worker: DictWorker, model: torch.nn.Module) -> bool:
    return worker.weights.keys() == model.state_dict().keys() and all(
        torch.equal(worker.weights[k], v) for k, v in model.state_dict().items())


def port_only_client(port: int, timeout_s: float = 3.0):
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def test_a_key_set_by_a_process_that_knows_only_the_port_changes_nothing(monkeypatch):
    """The audit's attack: one key (the go, set to "off" as soon as the store listened) made the worker refuse and
    the sync fail. Now the keys a join waits for are named by proofs of the nonce: what it sets is ignored."""
    real, seen = listening_store, {}

    def attacked(host, timeout_s):
        store = real(host, timeout_s)
        stranger = port_only_client(store.port)
        for key in ("stapo/go", "go"):  # the old protocol's go, and a guess
            stranger.set(key, "off")
        seen["keys"] = stranger.list_keys()
        return store
    monkeypatch.setattr(broadcast, "listening_store", attacked)
    model, server = policy(), FakeServer(worker=DictWorker())
    try:
        engine = ServerEngine([server.address], pad_token_id=0, limits=LIMITS)
        start = time.monotonic()
        sync_weights(model, engine, 1 << 12, version=1)
        took = time.monotonic() - start
    finally:
        server.close()
    assert engine.last_sync.ok, engine.last_sync
    assert holds(server.worker, model) and server.worker._stapo_version == 1
    assert len(seen["keys"]) == 2 and took < 10


def test_a_process_that_knows_only_the_port_cannot_join_in_a_servers_place(monkeypatch):
    """The server's join is slow (hung); a stranger checks in for its rank with the keys it can guess and waits
    for the go to form the group as rank 1. It is never let in: the trainer calls the sync off, naming the server."""
    real, ports = listening_store, []
    monkeypatch.setattr(broadcast, "listening_store", lambda *a: ports.append(real(*a)) or ports[-1])
    server = FakeServer()
    server.hang.set()  # the join RPC does not come back: the server never checks in
    session = BroadcastSession([(ServerClient(server.address), 1)], "127.0.0.1", timeout_s=5.0, backend="gloo",
                               join_timeout_s=2.0)
    result = {}

    def stranger():
        while not ports:
            time.sleep(0.01)
        store = port_only_client(ports[0].port)
        store.set("stapo/ready/1", "1")  # the old protocol's check-in
        try:
            store.wait(["stapo/go"], datetime.timedelta(seconds=2))
            options = dist.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=4)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            group = dist.ProcessGroupGloo(store, 1, 2, options)
            got = torch.empty(16, dtype=torch.uint8)
            group.broadcast(got, 0).wait()
            result["received"] = got
        except RuntimeError:
            result["refused"] = True
    thread = threading.Thread(target=stranger, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(SyncFailed, match=f"server\\(s\\) {server.address} did not join the weight sync") as failed:
            session.open()
        took = time.monotonic() - start
        thread.join(timeout=30)
    finally:
        server.close()
    assert failed.value.servers == (server.address,) and took < 5
    assert result == {"refused": True}  # nothing reached the stranger


def test_rank_0_and_every_receiver_prove_the_nonce_before_a_weight_byte_moves():
    """A store-level stranger that got as far as the group (it saw the go) but does not hold the nonce: the worker
    leaves before taking a byte, and rank 0 names the rank that failed before sending one."""
    nonce, listening = new_nonce(), listening_store("127.0.0.1", 10)
    spec = GroupSpec("127.0.0.1", listening.port, world_size=2, rank_offset=1, timeout_s=10, nonce=nonce)
    store, outcome = namespaced(listening, nonce), {}

    def worker():
        try:
            spec.join(1, CPU)
            outcome["worker"] = "joined"
        except PermissionError as err:
            outcome["worker"] = str(err)
    thread = threading.Thread(target=worker)
    thread.start()
    while not checked_in(store, nonce, 1, 1):
        time.sleep(0.01)
    let_form(store, nonce)
    group = spec.connect(0, store=store, bind_host="127.0.0.1")
    outcome["rank 0"] = exchange_proofs(group, new_nonce(), 0, 2, CPU)  # an impostor's proof, checked with its nonce
    thread.join(timeout=30)
    assert outcome["rank 0"] == [1]  # the worker's proof does not match the impostor's nonce either
    assert "rank 0 did not prove it holds this session's nonce" in outcome["worker"]


def test_a_join_cannot_keep_a_server_waiting_past_its_own_bounds(monkeypatch):
    """The audit: a join whose JSON asked for a wait of 1e9 s at a store that never gives the go wedged the worker
    (and the engine behind it). The worker clamps to its own bounds: vLLM's step limit here is 3 s."""
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3")
    listening = listening_store("127.0.0.1", 60)
    spec = GroupSpec("127.0.0.1", listening.port, world_size=2, rank_offset=1, timeout_s=1e9, nonce=new_nonce(),
                     join_timeout_s=1e9)
    done = {}

    def join():
        try:
            DictWorker().stapo_join_weight_group(spec.to_json())
        except PermissionError as err:
            done["error"] = str(err)
        done["at"] = time.monotonic()
    start = time.monotonic()
    threading.Thread(target=join, daemon=True).start()
    deadline = start + 30
    while "at" not in done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.get("error") == "the trainer gave no go for the weight group: session called off"
    assert done["at"] - start < 2.7 + 2  # the bound: 3 s less a tenth
    bounded = spec.bounded(900.0)
    assert (bounded.timeout_s, bounded.join_timeout_s) == (870.0, 60.0)
    assert spec.bounded(300.0).timeout_s == 270.0
    assert GroupSpec("h", 1, 2, timeout_s=5.0).bounded(900.0).timeout_s == 5.0  # within the bounds: as asked
    for field, bad in (("timeout_s", float("nan")), ("join_timeout_s", "30"), ("port", 0), ("rank_offset", True),
                       ("world_size", 1)):
        with pytest.raises(ValueError, match=f"weight-group spec: {field}"):
            GroupSpec.from_json(json.dumps({**json.loads(spec.to_json()), field: bad}))


class Flipping:
    """A group whose broadcasts arrive with their first byte changed (a transfer that corrupts data)."""

    def __init__(self, group) -> None:
        self.group = group

    def broadcast(self, tensor, root):
        work = self.group.broadcast(tensor, root)

        class Done:
            def wait(self):
                work.wait()
                tensor.view(-1)[:1] ^= 1
        return Done()


class CorruptedWorker(DictWorker):
    def stapo_join_weight_group(self, spec: str) -> int:
        rank = super().stapo_join_weight_group(spec)
        self._stapo_session.group = Flipping(self._stapo_session.group)
        return rank


def test_a_full_sync_whose_bytes_changed_on_the_way_is_not_committed(caplog):
    """Full syncs carry a checksum per bucket, as delta syncs do: a server that received other bytes than rank 0
    sent is aborted (it keeps its weights) and reported, not committed."""
    model, server = policy(), FakeServer(worker=CorruptedWorker())
    try:
        engine = ServerEngine([server.address], pad_token_id=0, limits=LIMITS)
        with caplog.at_level("WARNING", logger="stapo.rollout"):
            sync_weights(model, engine, 1 << 12, version=1)
    finally:
        server.close()
    assert not engine.last_sync.ok and engine.last_sync.failed == (server.address,)
    assert server.worker.weights == {} and getattr(server.worker, "_stapo_version", None) is None
    assert f"rollout server {server.address} holds other bytes than the trainer sent" in caplog.text
    assert server.worker._stapo_open_session() is None



def lose_rank(monkeypatch, lost: int) -> None:
    """The worker of rank ``lost`` checks in and gets the go, then fails where it would form the group: a server
    killed in that moment (its join call fails; it never connects)."""
    real = GroupSpec.connect

    def connect(spec, rank, store, bind_host=None):
        if rank == lost:
            raise RuntimeError("the server's process was killed")
        return real(spec, rank, store, bind_host)
    monkeypatch.setattr(GroupSpec, "connect", connect)


def test_a_server_lost_after_its_check_in_ends_the_formation_at_once(monkeypatch):
    """CI caught it on the real servers: a server killed after it checked in, before it joined the group, left rank 0
    in the formation until the sync's timeout (300 s) for a peer that never came. Its failed join now ends the wait,
    naming it."""
    lose_rank(monkeypatch, 1)
    server = FakeServer(worker=DictWorker())
    session = BroadcastSession([(ServerClient(server.address), 1)], "127.0.0.1", timeout_s=60.0, backend="gloo",
                               join_timeout_s=30.0)
    start = time.monotonic()
    try:
        with pytest.raises(SyncFailed, match=f"server\\(s\\) {server.address} failed while the weight group formed; "
                                             ".*the server's process was killed") as failed:
            session.open()
    finally:
        server.close()
    assert failed.value.servers == (server.address,)
    assert time.monotonic() - start < 10  # neither the formation's bound (30 s) nor the sync's timeout (60 s)


def test_the_server_left_is_held_only_for_the_formations_bound_and_takes_the_retry(monkeypatch):
    """The other side of it: the surviving server's worker waited in the formation for the lost one for the whole
    sync timeout, its engine blocked (one worker call at a time), so the retry found it silent and marked it down
    too: the run stopped with a healthy server. Forming is now bounded by ``sync_join_timeout_s`` on every rank,
    and the abort waits that out; the retry syncs the survivor."""
    lose_rank(monkeypatch, 2)  # the second server's worker (the first's is rank 1)
    survivor, lost = FakeServer(worker=DictWorker()), FakeServer(worker=DictWorker())
    limits = dataclasses.replace(LIMITS, sync_timeout_s=60.0, sync_join_timeout_s=2.0)
    model = policy()
    try:
        engine = ServerEngine([survivor.address, lost.address], pad_token_id=0, limits=limits)
        start = time.monotonic()
        sync_weights(model, engine, 1 << 12, version=1)
        first = engine.last_sync
        lost.close()  # (dead: it answers nothing more)
        sync_weights(model, engine, 1 << 12, version=1)  # the trainer's retry
        took = time.monotonic() - start
    finally:
        survivor.close()
    assert not first.ok and first.failed == (lost.address,) and "failed while the weight group formed" in first.error
    assert engine.last_sync.ok, engine.last_sync
    assert [c.address for c in engine.pool.live] == [survivor.address]
    assert holds(survivor.worker, model) and survivor.worker._stapo_version == 1
    assert took < 20  # the formation's bound (2 s) twice at most, not the sync's timeout (60 s)


def test_a_formed_group_gives_its_collectives_the_sync_timeout():
    """The formation's bound is lifted once every proof checked out: a bucket's broadcast may take ``timeout_s``."""
    nonce, listening = new_nonce(), listening_store("127.0.0.1", 10)
    spec = GroupSpec("127.0.0.1", listening.port, world_size=2, rank_offset=1, timeout_s=40, nonce=nonce,
                     join_timeout_s=5)
    store, joined = namespaced(listening, nonce), {}
    thread = threading.Thread(target=lambda: joined.setdefault("group", spec.join(1, CPU)))
    thread.start()
    while not checked_in(store, nonce, 1, 1):
        time.sleep(0.01)
    let_form(store, nonce)
    group, wrong = spec.form(0, store, CPU, "127.0.0.1")
    thread.join(timeout=30)
    assert wrong == []
    assert group.options._timeout == joined["group"].options._timeout == datetime.timedelta(seconds=40)
