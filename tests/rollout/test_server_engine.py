"""Rollout servers without a server: the pure pieces of rollout.mode=server (docs/rollout.md).

The real servers (vLLM's CPU build) are exercised by tests/vllm_cpu/test_server.py; here: the request
body and the reply's conversion, the pool's least-loaded choice and failover bookkeeping, ``stapo serve``'s
command line, and the weight transport's packing and process group on two real gloo processes."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp

from stapo.config import ConfigError, STAPOConfig
from stapo.rollout import Generation, SamplingParams
from stapo.rollout.sampling import vllm_request_kwargs
from stapo.rollout.trajectory import prompt_seeds
from stapo.serve.launcher import serve_command, take_token_file
from stapo.servers.client import MALFORMED, ServerClient, ServerError, parse_address
from stapo.servers.completions import completion_body, segment_from_reply
from stapo.servers.pool import NoRolloutServers, ServerPool
from stapo.sync.bucket_format import pack_bucket_tensor, unpack_tensors
from stapo.sync.weight_group import GroupSpec, namespaced, new_nonce


def test_a_request_carries_the_token_ids_and_the_colocated_seed():
    sampling = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=9, seed=3)
    requests = [t.request(9) for t in Generation([[1], [5, 6, 7]], 4, sampling).trajectories]
    body = completion_body(requests[5], vllm_request_kwargs(sampling))  # prompt 1, sample 1
    assert body["prompt"] == [5, 6, 7] and body["n"] == 1 and body["max_tokens"] == 9
    assert body["seed"] == prompt_seeds(3, 2)[1] + 1  # the in-process engine's seed for prompt 1, sample 1
    assert body["logprobs"] == 0 and body["return_token_ids"] is True and body["top_k"] == 20


def test_a_completion_reply_becomes_a_segment():
    reply = {"choices": [  # vLLM's /v1/completions reply shape
        {"index": 0, "text": "ac", "token_ids": [4, 2], "finish_reason": "length",
         "logprobs": {"token_logprobs": [-1.0, -2.0], "tokens": ["token_id:4", "token_id:2"]}}]}
    segment = segment_from_reply(reply, version=3)
    assert segment.tokens == [4, 2] and segment.logprobs == [-1.0, -2.0]
    assert segment.finish == "length" and segment.text == "ac" and segment.version == 3
    bad = {"choices": [{"index": 0, "text": "", "token_ids": [4], "finish_reason": "stop", "logprobs": None}]}
    with pytest.raises(ServerError, match="rollout server node3:8000: malformed completion reply: choice 0: 1 "
                                          "tokens, 0 log-probs") as failure:
        segment_from_reply(bad, "node3:8000")
    assert failure.value.kind == MALFORMED
    with pytest.raises(ServerError, match="2 choices, expected 1"):
        segment_from_reply({"choices": reply["choices"] * 2})


def test_the_pool_picks_the_least_loaded_live_server_and_fails_over(caplog):
    a, b, c = (ServerClient(f"127.0.0.1:{p}") for p in (8001, 8002, 8003))
    pool = ServerPool([a, b, c])
    assert [pool.acquire().address for _ in range(4)] == [a.address, b.address, c.address, a.address]
    pool.release(b)  # b now has the fewest in flight
    assert pool.acquire() is b
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        pool.mark_down(a, "connection refused")
    assert "rollout server 127.0.0.1:8001 is down (connection refused)" in caplog.text
    assert [x.address for x in pool.live] == [b.address, c.address] and pool.down == [a]
    pool.mark_down(b, "gone")
    pool.mark_down(c, "gone")
    with pytest.raises(NoRolloutServers, match="no rollout server is left: 127.0.0.1:8001: connection refused"):
        pool.acquire()
    pool.mark_live(a)
    assert pool.acquire() is a


@pytest.mark.parametrize("address, expected", [("127.0.0.1:8000", "127.0.0.1:8000"),
                                               ("http://node3:8001/", "node3:8001")])
def test_server_addresses_are_host_and_port(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("bad", ["node3", "node3:http", ":8000", "node3:70000"])
def test_a_bad_server_address_is_named(bad):
    with pytest.raises(ValueError, match="is not host:port"):
        parse_address(bad)


@pytest.mark.parametrize("override, message", [
    ("rollout.mode=remote", "rollout.mode must be one of"),
    ("rollout.mode=server", "rollout.mode=server needs rollout.server.addresses"),
    ("rollout.server.addresses=[node3]", "rollout.server.addresses: rollout server address 'node3' is not host:port"),
    ("rollout.max_staleness=1", "needs rollout.mode=server"),
    ("rollout.max_staleness=-1", "rollout.max_staleness must be >= 0"),
    ("rollout.server.request_timeout_s=0", "rollout.server.request_timeout_s must be > 0"),
    ("rollout.server.sync=sparse", "rollout.server.sync must be one of \\['full', 'delta'\\], got 'sparse'"),
    ("rollout.server.sync=delta", "rollout.server.sync=delta needs rollout.mode=server"),
])
def test_server_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_yaml(None, [override])


def test_asynchronous_training_refuses_dynamic_sampling():
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling needs rollout.max_staleness=0"):
        STAPOConfig.from_yaml(None, ["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:8000]",
                                     "rollout.max_staleness=1", "rollout.dynamic_sampling=true"])


def test_stapo_serve_adds_what_training_needs_and_keeps_the_users_options():
    argv, env = serve_command("/models/qwen", ["--port", "8001", "--logprobs-mode=raw_logprobs"], "py", {}, on_cpu=False)
    assert argv[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen"]
    assert "--worker-extension-cls" in argv and "stapo.serve.worker_extension.StapoWorkerExtension" in argv
    assert "--logprobs-mode=raw_logprobs" in argv and "processed_logprobs" not in argv  # the user's choice stays
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "--no-enable-chunked-prefill" not in argv
    # a sync waiting for the trainer (rollout.server.sync_timeout_s) must time out before vLLM's engine-step watchdog
    assert int(env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"]) > STAPOConfig().rollout.server.sync_timeout_s
    _, env = serve_command("/m", [], "py", {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"}, on_cpu=False)
    assert env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "60"  # the user's setting stays
    argv, env = serve_command("/m", ["--max-model-len", "8192"], "py", {"VLLM_CPU_KVCACHE_SPACE": "4"}, on_cpu=True)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192"  # whole prompts fit one step
    assert "--no-enable-chunked-prefill" in argv and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    with pytest.raises(ValueError, match="needs the model first"):
        serve_command("--port", [], "py", {}, on_cpu=True)


def test_stapo_serve_listens_on_loopback_and_guards_its_routes():
    argv, _ = serve_command("/m", ["--port", "8001"], "py", {}, on_cpu=False)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--middleware") + 1] == "stapo.serve.guard.ServerGuard"
    argv, _ = serve_command("/m", ["--host", "127.0.0.1"], "py", {}, on_cpu=False)
    assert argv.count("--host") == 1
    argv, env = serve_command("/m", ["--host=10.0.0.5"], "py", {}, on_cpu=False, secret="s3cret")
    assert "--host=10.0.0.5" in argv and env["STAPO_SERVER_TOKEN"] == "s3cret" and "s3cret" not in argv
    assert env["FORWARDED_ALLOW_IPS"] == ""  # uvicorn then takes no caller's address from X-Forwarded-For
    assert take_token_file(["--port", "1", "--token_file", "/s", "--dtype", "x"]) == ("/s", ["--port", "1", "--dtype",
                                                                                             "x"])
    assert take_token_file(["--token-file=/s", "--port", "1"]) == ("/s", ["--port", "1"])
    with pytest.raises(ValueError, match="--host is given 2 times"):
        serve_command("/m", ["--host", "127.0.0.1", "--host", "0.0.0.0"], "py", {}, on_cpu=False)
    with pytest.raises(ValueError, match="drop --api-key"):
        serve_command("/m", ["--api_key", "k"], "py", {}, on_cpu=False)
    with pytest.raises(ValueError, match="drop --api-key"):
        serve_command("/m", ["--api-key", "k"], "py", {}, on_cpu=False)
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        serve_command("/m", [], "py", {"VLLM_API_KEY": "k"}, on_cpu=False)


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=gen)), ("b.bias", torch.randn(7, generator=gen).bfloat16()),
            ("c.count", torch.arange(3, dtype=torch.int64))]


def _receive(rank: int, spec_json: str, out) -> None:
    spec = GroupSpec.from_json(spec_json)
    layout, flat = pack_bucket_tensor(_bucket())
    group = spec.connect(rank, spec.store())
    raw = torch.empty(layout["nbytes"], dtype=torch.uint8)
    group.broadcast(raw, 0).wait()
    received = unpack_tensors(layout, raw)  # compared here: tensors do not cross the queue
    out.put([(name, str(got.dtype), torch.equal(got, sent)) for (name, got), (_, sent) in zip(received, _bucket())])


def test_a_bucket_crosses_a_gloo_group_exactly():
    """The transport of a server sync on CPU: a GroupSpec joined by another process, one broadcast."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    spec = GroupSpec("127.0.0.1", store.port, world_size=2, rank_offset=1, timeout_s=60, nonce=new_nonce())
    assert GroupSpec.from_json(spec.to_json()) == spec and spec.nonce not in repr(spec)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(1, spec.to_json(), out))
    proc.start()
    group = spec.connect(0, store=namespaced(store, spec.nonce))
    layout, flat = pack_bucket_tensor(_bucket())
    assert [o % 16 for o in layout["offsets"]] == [0, 0, 0]
    group.broadcast(flat, 0).wait()
    received = out.get(timeout=60)
    proc.join(timeout=60)
    assert received == [(name, str(t.dtype), True) for name, t in _bucket()]
    with pytest.raises(ValueError, match="gloo or nccl"):
        GroupSpec("h", 1, 2, backend="mpi")


def test_the_dry_run_notes_servers_that_do_not_answer(capsys, tmp_path):
    import socket

    from stapo.cli import main

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = main(["train", "rollout.mode=server", f"rollout.server.addresses=[127.0.0.1:{port}]",
                 f"trainer.output_dir={tmp_path / 'run'}", "--dry-run"])
    assert code == 0  # a note, not an error: servers may be started after the dry run
    assert f"rollout server 127.0.0.1:{port} does not answer now (start it with `stapo serve MODEL --port {port}`)" \
        in capsys.readouterr().out
