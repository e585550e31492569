"""The closed control plane of ``stapo serve``: an ASGI middleware in front of vLLM's server.

vLLM's dev mode (needed for ``/collective_rpc``) serves routes that change what it serves, and its ``--api-key``
guards ``/v1`` only. The policy is pure (`route_decision`, `rpc_refusal`); the table: docs/rollout.md, "Security".
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os

from stapo.serve.secret import TOKEN_ENV, check_secret
from stapo.serve.staging import SERVER_RPC_METHODS

__all__ = ["GUARD_MIDDLEWARE", "ServerGuard", "authorized", "route_decision", "route_path", "rpc_refusal"]

GUARD_MIDDLEWARE = "stapo.serve.guard.ServerGuard"
OPEN, AUTHENTICATED, FORBIDDEN = "open", "authenticated", "forbidden"
_SERVED = frozenset({"/tokenize", "/detokenize", "/version", "/load", "/metrics", "/ping", "/reset_prefix_cache",
                     "/collective_rpc"})
_FORBIDDEN_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
_JOIN = "stapo_join_weight_group"
MAX_RPC_BODY = 1 << 20  # a bucket's JSON layout is a few KiB; anything this large is not stapo's


def route_path(scope: dict) -> str:
    """The path vLLM's router matches: ``scope["path"]`` less a leading ``root_path`` (``--root-path``; as
    Starlette's ``get_route_path``), with repeated and trailing slashes dropped."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        path = path[len(root):]
    return "/" + path.strip("/")


def route_decision(path: str) -> str:
    """``open`` (no secret needed), ``authenticated`` (served with the secret) or ``forbidden``."""
    path = "/" + path.strip("/")
    if path == "/health":
        return OPEN
    if path in _SERVED or path.startswith("/metrics/"):
        return AUTHENTICATED
    if path.startswith("/v1/") and path not in _FORBIDDEN_V1:
        return AUTHENTICATED
    return FORBIDDEN


def _same_host(host, peer: str | None) -> bool:
    """``host`` (an IP address) is the caller's address ``peer`` (loopback addresses are one; None: a UNIX socket,
    a local caller)."""
    try:
        ours = ipaddress.ip_address(host)
        theirs = ipaddress.ip_address(peer) if peer is not None else ipaddress.ip_address("127.0.0.1")
    except (TypeError, ValueError):
        return False
    ours, theirs = (getattr(a, "ipv4_mapped", None) or a for a in (ours, theirs))
    return ours == theirs or (ours.is_loopback and theirs.is_loopback)


def rpc_refusal(body: bytes, peer: str | None = None) -> str | None:
    """Why a ``/collective_rpc`` body is refused, or None: only `SERVER_RPC_METHODS`, string args, no kwargs, and
    a weight-group join only at a store on ``peer``'s address (the caller's, as the connection shows it)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "the body is not JSON"
    if not isinstance(request, dict):
        return "the body is not a JSON object"
    method = request.get("method")
    if not isinstance(method, str) or method not in SERVER_RPC_METHODS:
        return f"method {str(method)[:80]!r} is not one of stapo's worker methods"
    args = request.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return "args must be a list of strings"
    if request.get("kwargs"):
        return "keyword arguments are not accepted"
    if method == _JOIN:
        try:
            host = json.loads(args[0]).get("host")
        except (IndexError, ValueError, AttributeError):
            return "the join carries no weight-group spec"
        if not _same_host(host, peer):
            return (f"the weight group's store {str(host)[:80]!r} is not at the address this call came from ({peer}): "
                    "set rollout.server.sync_host to the trainer's address on the route to this server")
    return None


def authorized(headers: list[tuple[bytes, bytes]], token: str | None) -> bool:
    """The request carries ``Authorization: Bearer <token>``; False when there is no token."""
    if not token:
        return False
    given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
    return hmac.compare_digest(given, b"Bearer " + token.encode())


class ServerGuard:
    """Pure ASGI middleware applying `route_decision`, `authorized` and `rpc_refusal`."""

    def __init__(self, app, token: str | None = None) -> None:
        self.app = app
        if token is None and os.environ.get(TOKEN_ENV):
            try:
                token = check_secret(os.environ[TOKEN_ENV], TOKEN_ENV)
            except ValueError:
                token = None  # refused: every route but /health answers 401 (fails closed)
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = route_path(scope)
        decision = route_decision(path)
        if decision == OPEN:
            return await self.app(scope, receive, send)
        if not self.token:
            return await _refuse(scope, send, 401, f"this server has no usable shared secret ({TOKEN_ENV}): start it "
                                                   "with `stapo serve`, which always sets one")
        if not authorized(scope.get("headers", []), self.token):
            return await _refuse(scope, send, 401, f"this server needs the shared secret: send "
                                                   f"'Authorization: Bearer <{TOKEN_ENV}>'")
        if decision == FORBIDDEN:
            return await _refuse(scope, send, 403, f"{path} is not served by stapo serve")
        if scope["type"] == "http" and path == "/collective_rpc":
            body, complete = await _read_body(receive)
            peer = (scope.get("client") or (None,))[0]
            why = "the body is too large" if not complete else rpc_refusal(body, peer)
            if why is not None:
                return await _refuse(scope, send, 403, f"collective_rpc refused: {why}")
            return await self.app(scope, _replay(body, receive), send)
        return await self.app(scope, receive, send)


async def _read_body(receive) -> tuple[bytes, bool]:
    """The request body, and False once it passes `MAX_RPC_BODY` (the rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_RPC_BODY:
            return b"", False
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed


async def _refuse(scope, send, status: int, detail: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    payload = json.dumps({"error": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
