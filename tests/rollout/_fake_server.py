"""A small stand-in for `stapo serve` (http.server on loopback) whose replies a test chooses: what the
engine's bookkeeping does with 4xx, 5xx, malformed replies, hangs, refused sessions and foreign models,
without a vLLM process. The real servers run the same paths in tests/vllm_cpu/test_vllm_server_faults.py."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from stapo.serve.staging import ServerWorkerMixin


class DictWorker(ServerWorkerMixin):
    """stapo's worker side of a weight session (the real `ServerWorkerMixin`: join, receive, stage, keep, commit,
    abort) with a dict of tensors in place of vLLM's model: what a server's worker holds, without vLLM."""

    device = torch.device("cpu")
    rank = 0

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}  # the "served model"
        self._pending: dict[str, torch.Tensor] | None = None

    def stapo_begin_weight_update(self) -> None:
        self._pending = {}

    def _stapo_load(self, weights) -> int:
        self._pending.update((name, tensor.clone()) for name, tensor in weights)
        return len(weights)

    def stapo_finish_weight_update(self, version=None) -> None:
        self.weights.update(self._pending)
        self._pending = None
        if version is not None:
            self._stapo_version = int(version)

    def _stapo_model(self):
        weights = self.weights

        class Served:
            def state_dict(self):
                return dict(sorted(weights.items()))
        return Served()


class FakeServer:
    """``/health``, ``/v1/models``, ``/v1/completions`` and stapo's worker RPCs. Knobs (plain attributes):
    ``completion(body) -> (status, reply or bytes)``; ``hang`` (every route but none answers until cleared);
    ``fingerprint`` (dict or None); ``session_open``; ``join_status``; ``token`` (required bearer secret);
    ``worker``: a `DictWorker` that answers every stapo worker RPC instead (a restart: assign a new one)."""

    def __init__(self, *, fingerprint: dict | None = None, max_model_len: int = 512, token: str | None = None,
                 worker: DictWorker | None = None) -> None:
        self.fingerprint, self.max_model_len, self.token, self.worker = fingerprint, max_model_len, token, worker
        self.version: int | None = None
        self.instance = uuid.uuid4().hex
        self.session_open = False
        self.join_status = 500
        self.hang = threading.Event()
        self.engine_core = threading.Lock()  # vLLM's engine core runs one worker call at a time
        self.calls: list[tuple[str, str]] = []  # (path, method or "")
        self.completion = lambda body: (200, self.good_reply(body))
        self.stream_tokens, self.stream_delay = 6, 0.0  # streamed segments: tokens per request, seconds per token
        self.streamed: list[dict] = []  # the bodies of streamed requests
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake._serve(self, None)

            def do_POST(self):
                fake._serve(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.hang.clear()
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def good_reply(body: dict) -> dict:
        """``n`` choices of 2 tokens each (ids 5 + prompt length, 6), log-probs -0.5 and -0.25."""
        first = 5 + len(body["prompt"])
        return {"choices": [{"index": i, "text": "ab", "token_ids": [first, 6], "finish_reason": "stop",
                             "logprobs": {"token_logprobs": [-0.5, -0.25]}} for i in range(body["n"])]}

    def _serve(self, handler, body) -> None:
        path = handler.path
        self.calls.append((path, (body or {}).get("method", "")))
        while self.hang.is_set():
            time.sleep(0.05)
        if self.token and handler.headers.get("Authorization") != f"Bearer {self.token}" and path != "/health":
            return self._reply(handler, 401, {"error": "needs the secret"})
        if path == "/health":
            return self._reply(handler, 200, b"")
        if path == "/v1/models":
            return self._reply(handler, 200, {"data": [{"id": "m", "max_model_len": self.max_model_len}]})
        if path == "/v1/completions" and body.get("stream"):
            return self._stream(handler, body)
        if path == "/v1/completions":
            return self._reply(handler, *self.completion(body))
        if path == "/reset_prefix_cache":
            return self._reply(handler, 200, b"")
        if path == "/collective_rpc" and self.worker is not None and body["method"] != "stapo_fingerprint":
            return self._worker_rpc(handler, body["method"], body.get("args", []))
        if path == "/collective_rpc":
            return self._rpc(handler, body["method"])
        return self._reply(handler, 404, {"error": "not found"})

    def _rpc(self, handler, method: str) -> None:
        if method == "stapo_server_state":
            state = {"version": self.version, "instance": self.instance, "session_open": self.session_open}
            return self._reply(handler, 200, {"results": [json.dumps(state)]})
        if method == "stapo_fingerprint" and self.fingerprint is not None:
            return self._reply(handler, 200, {"results": [json.dumps(self.fingerprint)]})
        if method == "stapo_abort_weight_update":
            was, self.session_open = self.session_open, False
            return self._reply(handler, 200, {"results": [was]})
        if method == "stapo_join_weight_group":
            return self._reply(handler, self.join_status, {"error": "join refused"})
        return self._reply(handler, 500, {"error": f"{method} refused"})

    def _worker_rpc(self, handler, method: str, args: list) -> None:
        try:
            with self.engine_core:
                result = getattr(self.worker, method)(*args)
        except Exception as err:  # what vLLM's route answers when a worker method raises
            return self._reply(handler, 500, {"error": f"{type(err).__name__}: {err}"})
        return self._reply(handler, 200, {"results": [result]})

    @staticmethod
    def streamed_token(seed: int, position: int) -> int:
        """What a streamed request of ``seed`` samples at ``position`` (so tests can check seeds)."""
        return 10 + (seed * 7 + position) % 50

    def _stream(self, handler, body: dict) -> None:
        """One sample streamed a token per event (``stream_delay`` apart), ``finish_reason`` "length" when
        ``max_tokens`` ran out, else "stop" after ``stream_tokens``."""
        self.streamed.append(body)
        count = min(body["max_tokens"], self.stream_tokens)
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.end_headers()
            for pos in range(count):
                time.sleep(self.stream_delay)
                finish = None if pos < count - 1 else ("length" if count == body["max_tokens"] else "stop")
                token = self.streamed_token(body.get("seed", 0), pos)
                event = {"choices": [{"index": 0, "text": f"<{token}>", "token_ids": [token], "finish_reason": finish,
                                      "logprobs": {"token_logprobs": [-0.01 * token]}}]}
                handler.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                handler.wfile.flush()
            handler.wfile.write(b"data: [DONE]\n\n")
        except OSError:  # the client cut the stream
            pass

    @staticmethod
    def _reply(handler, status: int, body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:  # the client cut the request (the engine's health watch): nobody to answer
            pass
