"""The closed control plane of `stapo serve` (stapo.rollout.server_guard), as a plain ASGI app: which
routes need the secret, which are refused whatever the credentials, which worker methods pass. The real
server runs it in tests/vllm_cpu/test_server_faults.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from stapo.rollout.server_guard import AUTHENTICATED, FORBIDDEN, OPEN, ServerGuard, route_decision, rpc_refusal
from stapo.rollout.server_worker import SERVER_RPC_METHODS


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


def test_only_stapos_worker_methods_with_string_arguments_pass():
    assert all(rpc_refusal(json.dumps({"method": m, "args": ["x"]}).encode()) is None for m in SERVER_RPC_METHODS)
    assert "not one of stapo's worker methods" in rpc_refusal(b'{"method": "__class__", "args": []}')
    assert "not one of stapo's worker methods" in rpc_refusal(b'{"method": "stapo_load_weights", "args": []}')
    assert "not one of stapo's worker methods" in rpc_refusal(b'{"method": "execute_model"}')
    assert rpc_refusal(b'{"method": "stapo_server_state", "args": [1]}') == "args must be a list of strings"
    assert rpc_refusal(b'{"method": "stapo_server_state", "kwargs": {"a": "b"}}') == \
        "keyword arguments are not accepted"
    assert rpc_refusal(b"[1]") == "the body is not a JSON object" and rpc_refusal(b"{") == "the body is not JSON"


def call(path: str, body: bytes = b"", token: str | None = None) -> tuple[int, bytes | None]:
    """One HTTP request through ``guard`` in front of an app that echoes the body it receives."""
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
    asyncio.run(ServerGuard(app, token="s3cret")({"type": "http", "path": path, "headers": headers}, receive, send))
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


def test_without_a_secret_the_routes_stay_guarded_but_open_to_loopback_callers():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    statuses = []

    async def send(message):
        statuses.append(message.get("status"))

    async def receive():
        return {"type": "http.request", "body": b'{"method": "stapo_server_state"}', "more_body": False}
    guard = ServerGuard(app, token="")
    for path in ("/v1/models", "/server_info", "/collective_rpc"):
        asyncio.run(guard({"type": "http", "path": path, "headers": []}, receive, send))
    assert [s for s in statuses if s is not None] == [200, 403, 200]
