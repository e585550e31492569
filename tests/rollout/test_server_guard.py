"""The closed control plane of `stapo serve` (stapo.serve.guard), as a plain ASGI app: which
routes need the secret, which are refused whatever the credentials, which worker methods pass, where a join may
point a server. The real server runs it in tests/vllm_cpu/test_vllm_server_faults.py and test_server_security.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from stapo.serve.guard import (AUTHENTICATED, FORBIDDEN, OPEN, ServerGuard, route_decision, route_path,
                                        rpc_refusal)
from stapo.serve.staging import SERVER_RPC_METHODS
from stapo.sync.weight_group import GroupSpec, new_nonce


@pytest.mark.parametrize("path, decision", [
    ("/health", OPEN), ("/v1/completions", AUTHENTICATED), ("/v1/models", AUTHENTICATED),
    ("/collective_rpc", AUTHENTICATED), ("/reset_prefix_cache", AUTHENTICATED), ("/metrics", AUTHENTICATED),
    ("/tokenize", AUTHENTICATED), ("/v1/load_lora_adapter", FORBIDDEN), ("/sleep", FORBIDDEN),
    ("/wake_up", FORBIDDEN), ("/server_info", FORBIDDEN), ("/update_weights", FORBIDDEN),
    ("/init_weight_transfer_engine", FORBIDDEN), ("/pause", FORBIDDEN), ("/start_profile", FORBIDDEN),
    ("/docs", FORBIDDEN), ("/", FORBIDDEN), ("//health/", OPEN),
])
def test_each_route_is_open_authenticated_or_refused(path, decision):
    assert route_decision(path) == decision


@pytest.mark.parametrize("path, root, routed", [
    ("/v1/models", "", "/v1/models"), ("/metrics/collective_rpc", "/metrics", "/collective_rpc"),
    ("/v1/sleep", "/v1", "/sleep"), ("/api/health", "/api", "/health"), ("/v1/models", "/api", "/v1/models"),
    ("/apix/sleep", "/api", "/apix/sleep"), ("/api", "/api", "/"), ("//collective_rpc/", "", "/collective_rpc"),
])
def test_routes_are_decided_on_the_path_the_router_matches(path, root, routed):
    """Starlette routes ``path`` less ``--root-path``: with ``--root-path /metrics``, /metrics/collective_rpc IS
    /collective_rpc (its body is checked) and /v1/sleep under ``--root-path /v1`` IS /sleep (refused)."""
    assert route_path({"path": path, "root_path": root}) == routed


def join(host: str) -> bytes:
    spec = GroupSpec(host, 29500, world_size=2, rank_offset=1, nonce=new_nonce())
    return json.dumps({"method": "stapo_join_weight_group", "args": [spec.to_json()]}).encode()


def test_only_stapos_worker_methods_with_string_arguments_pass():
    ours = [json.dumps({"method": m, "args": ["x"]}).encode() for m in SERVER_RPC_METHODS - {"stapo_join_weight_group"}]
    assert all(rpc_refusal(body) is None for body in ours)
    for method in ([], {}, 7, None, ["stapo_server_state"]):  # not a string: refused, never an exception (a 500)
        assert "not one of stapo's worker methods" in rpc_refusal(json.dumps({"method": method}).encode())
    assert "not one of stapo's worker methods" in rpc_refusal(b'{"method": "__class__", "args": []}')
    assert "not one of stapo's worker methods" in rpc_refusal(b'{"method": "stapo_load_weights", "args": []}')
    assert "not one of stapo's worker methods" in rpc_refusal(b'{"method": "execute_model"}')
    assert rpc_refusal(b'{"method": "stapo_server_state", "args": [1]}') == "args must be a list of strings"
    assert rpc_refusal(b'{"method": "stapo_server_state", "kwargs": {"a": "b"}}') == \
        "keyword arguments are not accepted"
    assert rpc_refusal(b"[1]") == "the body is not a JSON object" and rpc_refusal(b"{") == "the body is not JSON"


def test_a_join_may_point_a_server_only_at_the_callers_own_address():
    """A server never connects where a caller points it: the store of a join must be at the address the call came
    from (loopback addresses are one; a UNIX socket's caller is local)."""
    assert rpc_refusal(join("10.0.0.5"), peer="10.0.0.5") is None
    assert rpc_refusal(join("127.0.0.1"), peer="127.0.0.1") is None
    assert rpc_refusal(join("::1"), peer="127.0.0.1") is None
    assert rpc_refusal(join("10.0.0.5"), peer="::ffff:10.0.0.5") is None
    assert rpc_refusal(join("127.0.0.1"), peer=None) is None
    for host, peer in (("10.0.0.9", "10.0.0.5"), ("192.0.2.1", "127.0.0.1"), ("127.0.0.1", "10.0.0.5"),
                       ("trainer.local", "10.0.0.5"), ("10.0.0.5", None)):
        assert "is not at the address this call came from" in rpc_refusal(join(host), peer=peer), (host, peer)
    bad = json.dumps({"method": "stapo_join_weight_group", "args": []}).encode()
    assert rpc_refusal(bad, peer="127.0.0.1") == "the join carries no weight-group spec"


def call(path: str, body: bytes = b"", token: str | None = None, root_path: str = "",
         guard_token: str | None = "s3cret", client: tuple | None = ("127.0.0.1", 50000)) -> tuple[int, bytes | None]:
    """One HTTP request through ``ServerGuard(token=guard_token)`` in front of an app that echoes the body."""
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen["body"] = message.get("body", b"")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    chunks = [body[:5], body[5:]] if len(body) > 5 else [body]  # the body arrives in two messages
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    scope = {"type": "http", "path": path, "root_path": root_path, "headers": headers, "client": client}
    asyncio.run(ServerGuard(app, token=guard_token)(scope, receive, send))
    return sent[0]["status"], seen.get("body")


def test_the_guard_answers_401_403_or_passes_the_request_on_unchanged():
    assert call("/health")[0] == 200  # liveness needs no secret
    assert call("/v1/models")[0] == 401
    assert call("/v1/models", token="wrong")[0] == 401
    assert call("/v1/models", token="s3cret")[0] == 200
    assert call("/sleep", token="s3cret")[0] == 403
    foreign = json.dumps({"method": "__init__", "args": []}).encode()
    assert call("/collective_rpc", foreign, token="s3cret") == (403, None)
    ours = json.dumps({"method": "stapo_server_state", "args": []}).encode()
    assert call("/collective_rpc", ours, token="s3cret") == (200, ours)  # replayed whole
    assert call("/collective_rpc", b" " * (2 << 20), token="s3cret")[0] == 403  # too large
    assert call("/collective_rpc", json.dumps({"method": ["x"]}).encode(), token="s3cret")[0] == 403  # not a 500
    assert call("/collective_rpc", join("127.0.0.1"), token="s3cret")[0] == 200
    assert call("/collective_rpc", join("192.0.2.1"), token="s3cret") == (403, None)  # never reaches the worker


def test_under_a_root_path_the_guard_checks_the_route_the_router_takes():
    foreign = json.dumps({"method": "execute_model", "args": []}).encode()
    # --root-path /metrics: /metrics/collective_rpc is routed to /collective_rpc, its body checked
    assert call("/metrics/collective_rpc", foreign, token="s3cret", root_path="/metrics") == (403, None)
    assert call("/v1/sleep", token="s3cret", root_path="/v1")[0] == 403  # routed to /sleep
    assert call("/api/v1/models", token="s3cret", root_path="/api")[0] == 200
    assert call("/api/health", root_path="/api")[0] == 200


def test_without_a_usable_secret_every_route_but_health_is_refused(monkeypatch):
    """A guard without a secret fails closed, on loopback too (`stapo serve` always gives it one)."""
    for env in (None, "", "  ", "a b"):
        if env is None:
            monkeypatch.delenv("STAPO_SERVER_TOKEN", raising=False)
        else:
            monkeypatch.setenv("STAPO_SERVER_TOKEN", env)
        ours = json.dumps({"method": "stapo_server_state", "args": []}).encode()
        assert call("/collective_rpc", ours, guard_token=None)[0] == 401, env
        assert call("/v1/models", token="a b", guard_token=None)[0] == 401, env
        assert call("/health", guard_token=None)[0] == 200
    monkeypatch.setenv("STAPO_SERVER_TOKEN", "from-the-env")
    assert call("/v1/models", token="from-the-env", guard_token=None)[0] == 200
