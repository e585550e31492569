"""The rollout servers' security against REAL `stapo serve` processes (vLLM's CPU build, loopback): what a process
that does not hold the secret can do — nothing but ask /health — and what the user had to do for it — nothing
(docs/rollout.md, "Security"). Each test adds its figure to the lane's summary (conftest.FAULT_FIGURES).

One server of its own, started as a user who set nothing: no STAPO_SERVER_TOKEN, its cache in a fresh directory
(where it makes the secret's file), and ``--root-path /metrics`` (under which the guard once matched the wrong
path). The attacks on a running sync use the lane's two servers."""

from __future__ import annotations

import json
import stat
import time
import urllib.error
import urllib.request

import pytest
import torch
from _servers import VLLMServer
from conftest import LANE_TOKEN
from test_vllm_server_faults import figure, state, status

from stapo.rollout import SamplingParams, generate
from stapo.serve.secret import trainer_secret
from stapo.servers.engine import ServerEngine
from stapo.sync import broadcast
from stapo.sync.weight_group import GroupSpec, listening_store, new_nonce

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def bare(warm_model_dir, tmp_path_factory):
    """`stapo serve` with nothing set: ``(server, its STAPO_CACHE)``."""
    cache = tmp_path_factory.mktemp("user_cache")
    server = VLLMServer(warm_model_dir, cache / "server.log", args=("--root-path", "/metrics"),
                        STAPO_SERVER_TOKEN="", STAPO_CACHE=str(cache))
    try:
        yield server.start().wait_ready(), cache
    finally:
        server.stop()


def test_a_server_started_with_nothing_set_makes_a_secret_and_answers_only_to_it(bare):
    server, cache = bare
    start = time.monotonic()
    path = cache / "server_token"
    first = server.log_path.read_text().splitlines()[0]
    assert first == (f"stapo serve: the shared secret is in {path} (created, mode 0600; the trainer on this machine "
                     "reads it by default)")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = trainer_secret({"STAPO_CACHE": str(cache)}, None)  # what the trainer finds with no setting
    assert status(server.address, "/health") == 200
    # a local process without the secret drove a whole weight session here (join, buckets, commit: version 999)
    spec = GroupSpec("127.0.0.1", 29500, world_size=2, rank_offset=1, nonce=new_nonce())
    for method, arg in (("stapo_join_weight_group", spec.to_json()), ("stapo_abort_weight_update", ""),
                        ("stapo_commit_weight_update", json.dumps({"nonce": spec.nonce, "version": 999}))):
        assert status(server.address, "/collective_rpc", {"method": method, "args": [arg]}) == 401, method
    assert status(server.address, "/v1/models") == 401 and status(server.address, "/v1/models", token="x") == 401
    assert status(server.address, "/v1/models", token=secret) == 200
    # --root-path /metrics: /metrics/<route> is routed to /<route>, and decided as that route
    assert status(server.address, "/metrics/server_info", token=secret) == 403
    assert status(server.address, "/metrics/collective_rpc", {"method": "no_such_method", "args": []},
                  token=secret) == 403
    figure("stapo serve with nothing set: a 0600 secret file, 401 without it (loopback), 403 under --root-path",
           time.monotonic() - start)


def test_the_trainer_syncs_into_it_with_no_setting(bare, warm_model_dir, prompts):
    """The trainer's secret comes from the default file; a full sync (checksums per bucket, proofs of the nonce in
    the real worker) commits."""
    from transformers import AutoModelForCausalLM

    from stapo.sync.buckets import sync_weights

    server, cache = bare
    start = time.monotonic()
    engine = ServerEngine([server.address], pad_token_id=0, token=trainer_secret({"STAPO_CACHE": str(cache)}, None))
    model = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    sync_weights(model, engine, bucket_bytes=2**20, version=3)
    assert engine.last_sync.ok, engine.last_sync
    assert engine.policy_versions() == {server.address: [3]}
    assert len(generate(engine, prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=4))) == len(prompts)
    figure("trainer with no setting: full sync into the server that made its own secret", time.monotonic() - start)


@pytest.fixture
def both(servers):
    for s in servers:
        s.ensure_running()
    return servers


def test_a_join_may_not_point_a_server_at_another_store_or_call_a_foreign_method(both):
    """An authenticated caller once made a worker connect wherever a join's JSON said (for up to its own
    timeouts); a ``method`` that is not a string was a 500."""
    start = time.monotonic()
    spec = GroupSpec("192.0.2.1", 29500, world_size=2, rank_offset=1, timeout_s=5, join_timeout_s=5, nonce=new_nonce())
    join = {"method": "stapo_join_weight_group", "args": [spec.to_json()]}
    assert status(both[0].address, "/collective_rpc", join, token=LANE_TOKEN) == 403
    headers = {"Authorization": f"Bearer {LANE_TOKEN}", "X-Forwarded-For": "192.0.2.1"}
    forwarded = urllib.request.Request(f"http://{both[0].address}/collective_rpc", data=json.dumps(join).encode(),
                                       headers=headers)
    with pytest.raises(urllib.error.HTTPError, match="403"):  # a header does not make the caller 192.0.2.1
        urllib.request.urlopen(forwarded, timeout=30)
    for method in (["stapo_server_state"], {}, 7):
        assert status(both[0].address, "/collective_rpc", {"method": method, "args": []}, token=LANE_TOKEN) == 403
    assert state(both[0])["session_open"] is False
    figure("join at another host's store / non-string method: 403", time.monotonic() - start)


def test_a_process_with_the_stores_port_neither_stops_nor_joins_a_real_sync(both, warm_model_dir, monkeypatch):
    """The audit's attack: a process that knows the port of the trainer's TCPStore (/proc/net/tcp) set one key as
    the store came up — the go, "off" — and every server refused the sync. Now that key is nobody's: the sync into
    both servers commits."""
    import datetime

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from stapo.sync.buckets import sync_weights

    real, listed = listening_store, []

    def attacked(host, timeout_s):
        store = real(host, timeout_s)
        stranger = dist.TCPStore(host, store.port, None, False, timeout=datetime.timedelta(seconds=5))
        stranger.set("stapo/go", "off")  # the old protocol's go
        listed.append(stranger.list_keys())
        return store
    monkeypatch.setattr(broadcast, "listening_store", attacked)
    engine = ServerEngine([s.address for s in both], pad_token_id=0, token=LANE_TOKEN)
    model = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    start = time.monotonic()
    sync_weights(model, engine, bucket_bytes=2**20, version=21)
    took = time.monotonic() - start
    assert engine.last_sync.ok and engine.last_sync.failed == (), engine.last_sync
    assert engine.policy_versions() == {s.address: [21] for s in both} and listed[0] == ["stapo/go"]
    figure("keys set in the trainer's store by a process with its port: ignored, the sync into 2 servers commits",
           took)
