"""Delta weight syncs end to end without vLLM: `ServerEngine` (rank 0's copy, the session, the checksums) into
stand-in servers whose workers are stapo's real worker side over gloo on loopback (tests/rollout/_fake_server.py,
`DictWorker`: a dict in place of vLLM's model). Real servers: tests/vllm_cpu/test_vllm_server_delta.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from _fake_server import DictWorker, FakeServer
from stapo.servers.client import ServerClient
from stapo.servers.engine import ServerEngine, ServerLimits
from stapo.sync.buckets import sync_weights

LIMITS = ServerLimits(request_retries=0, health_interval_s=0.2, health_timeout_s=2.0, sync_timeout_s=20.0)
BUCKET = 8192  # bytes: the 64 x 64 bf16 weight fills one bucket, the rest share the next


@pytest.fixture
def fakes():
    made = []

    def make() -> FakeServer:
        made.append(FakeServer(worker=DictWorker()))
        return made[-1]
    yield make
    for server in made:
        server.close()


def policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).to(torch.bfloat16)


def same_bytes(worker: DictWorker, model: torch.nn.Module) -> bool:
    held = worker.weights
    return held.keys() == dict(model.state_dict()).keys() and all(
        torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)) for name, t in model.state_dict().items())


def checksums(server: FakeServer) -> dict:
    return ServerClient(server.address).rpc_json("stapo_weight_checksums", timeout_s=30)[0]


def sync(model, engine, version):
    stats = sync_weights(model, engine, BUCKET, version=version)
    assert engine.last_sync.ok, engine.last_sync
    return stats.transfer


def test_delta_syncs_send_the_changes_and_leave_the_servers_bit_identical(fakes):
    model, a, b = policy(), fakes(), fakes()
    delta = ServerEngine([a.address], pad_token_id=0, limits=LIMITS, sync="delta")
    full = ServerEngine([b.address], pad_token_id=0, limits=LIMITS)
    words = sum(p.numel() for p in model.parameters())  # 64*64 + 64 + 64*32 + 32 = 6240 bf16 words
    first = sync(model, delta, 1)
    assert first.sent_bytes == first.dense_bytes and first.compared_words == 0  # nothing held yet: whole
    with torch.no_grad():
        model[0].weight.view(-1)[:5] += 1.0  # 5 words of the first bucket
        model[1].bias[:2] -= 1.0  # 2 of the second
    second = sync(model, delta, 2)
    # 5 changes: 20 bytes of positions -> 32, + 10 = 42; 2 changes: 8 -> 16 + 4 = 20
    assert second.sent_bytes == 42 + 20 and second.changed_words == 7 and second.compared_words == words
    with torch.no_grad():
        model[1].weight.mul_(3.0)  # most of the second bucket changes: it goes whole
    third = sync(model, delta, 3)
    assert third.sent_bytes == 2 * (64 * 32 + 64 + 32)  # first bucket unchanged (0 bytes), second whole
    assert sync(model, delta, 4).sent_bytes == 0
    sync(model, full, 4)
    assert same_bytes(a.worker, model) and same_bytes(b.worker, model)
    assert checksums(a)["served"] == checksums(b)["served"] and checksums(a)["version"] == 4
    assert checksums(b)["kept"] == {}  # a full sync keeps no copy on the server


def test_a_restarted_server_gets_a_full_sync(fakes, caplog):
    model, a = policy(), fakes()
    engine = ServerEngine([a.address], pad_token_id=0, limits=LIMITS, sync="delta")
    sync(model, engine, 1)
    a.worker = DictWorker()  # a new worker instance: no weights, no copy, version None
    with torch.no_grad():
        model[0].bias[0] += 1.0
    with caplog.at_level(logging.INFO, logger="stapo.rollout"):
        restarted = sync(model, engine, 2)
    assert restarted.sent_bytes == restarted.dense_bytes and restarted.changed_words == 1
    assert "does not hold the weights last sent" in caplog.text and same_bytes(a.worker, model)


def test_a_checksum_mismatch_is_logged_and_forces_a_full_sync_of_that_server(fakes, caplog):
    model, a, b = policy(), fakes(), fakes()
    engine = ServerEngine([a.address, b.address], pad_token_id=0, limits=LIMITS, sync="delta")
    sync(model, engine, 1)
    key = next(iter(b.worker._stapo_kept))
    b.worker._stapo_kept[key][100] ^= 1  # b's copy of a bucket is not what it received
    before = checksums(b)
    with torch.no_grad():
        model[0].weight.view(-1)[0] += 1.0
        model[1].weight.view(-1)[0] += 1.0
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        transfer = sync(model, engine, 2)
    assert transfer.sent_bytes < transfer.dense_bytes  # a delta sync ...
    assert f"rollout server {b.address} holds other bytes than the trainer sent" in caplog.text
    assert engine.last_sync.failed == (b.address,) and [c.address for c in engine.pool.live] == [a.address]
    assert checksums(b) == before  # ... that b did not commit: its version, copy and weights are as before
    assert same_bytes(a.worker, model) and not same_bytes(b.worker, model)
    healed = sync(model, engine, 3)
    assert healed.sent_bytes == healed.dense_bytes and len(engine.pool.live) == 2  # whole, for both
    assert same_bytes(b.worker, model) and checksums(a) == checksums(b)


def test_a_session_left_by_a_failed_trainer_never_commits_and_keeps_the_copy(fakes):
    model, a = policy(), fakes()
    engine = ServerEngine([a.address], pad_token_id=0, limits=LIMITS, sync="delta")
    sync(model, engine, 1)
    before = checksums(a)
    with torch.no_grad():
        model[0].weight.view(-1)[:3] += 1.0
    with pytest.raises(RuntimeError, match="the trainer fails mid-sync"):
        with engine.weight_update(version=2):
            engine.load_weights(list(model.state_dict().items())[:1])  # one delta bucket staged, then a failure
            raise RuntimeError("the trainer fails mid-sync")
    assert json.loads(a.worker.stapo_server_state())["session_open"]
    assert a.worker.stapo_abort_weight_update("")  # what the next trainer does first
    assert checksums(a) == before  # the kept copy and the served weights are those of version 1
    assert engine.sent.version is None  # rank 0's copy went with the failed sync: the next one is whole
    transfer = sync(model, engine, 2)
    assert transfer.sent_bytes == transfer.dense_bytes and same_bytes(a.worker, model)


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_rollout_sync_reaches_the_server_engine(mode, tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from stapo.config import STAPOConfig
    from stapo.serve.fingerprint import model_fingerprint, tokenizer_fingerprint
    from stapo.trainer.server_setup import build_server_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    server = FakeServer(fingerprint={"model": model_fingerprint(AutoConfig.from_pretrained(tiny_model_dir),
                                                                torch.float32),
                                     "tokenizer": tokenizer_fingerprint(tokenizer)}, worker=DictWorker())
    try:
        cfg = STAPOConfig.from_yaml(None, ["rollout.mode=server", f"rollout.server.addresses=[{server.address}]",
                                           "model.dtype=fp32", f"rollout.server.sync={mode}"])
        engine = build_server_engine(cfg, str(tiny_model_dir), tokenizer, torch.float32)
        assert (engine.sent is not None) == (mode == "delta")
        assert build_server_engine(cfg, str(tiny_model_dir), tokenizer, torch.float32, dist_rank=1).sent is None
    finally:
        server.close()
    with pytest.raises(ValueError, match="rollout.server.sync must be one of"):
        ServerEngine(["127.0.0.1:1"], pad_token_id=0, sync="sparse")
