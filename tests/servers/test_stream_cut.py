"""A streamed segment cut by `ServerEngine.interrupt` (a weight sync, ``rollout.partial``) keeps the tokens it received
and ends ``"interrupted"`` — decided from the engine's interrupts, never from what error the cut socket surfaced as
or when the segment's thread looked — while a 5xx without an interrupt is still retried (docs/rollout.md, "Partial
rollouts", "Faults"). Against a loopback stub that streams chunked server-sent events as vLLM's server does."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from unittest import mock

import pytest

import stapo.servers.engine as server_engine
import stapo.servers.pool as server_pool
from stapo.rollout import SamplingParams, SegmentRequest
from stapo.servers.engine import ServerEngine, ServerLimits

LIMITS = ServerLimits(request_retries=1, health_interval_s=0.2, health_timeout_s=1.0, request_timeout_s=10.0)
ERROR_500 = {"error": {"object": "error", "message": "engine step failed", "type": "InternalServerError", "code": 500}}


def token_event(token: int, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": f"<{token}>", "token_ids": [token], "finish_reason": finish,
                         "logprobs": {"token_logprobs": [-0.01 * token]}}]}


class StreamStub:
    """``/health``, ``/v1/models``, the server state RPC and streamed ``/v1/completions``: stream number ``k``
    sends ``scripts[k]``'s events, the first ``hold`` of them at once and the rest once ``release`` is set (or
    the client went away), as HTTP/1.1 chunks."""

    def __init__(self, *scripts: list[dict], hold: int = 2) -> None:
        self.scripts, self.hold, self.streams = list(scripts), hold, 0
        self.release = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                stub._json(self, {"data": [{"id": "m", "max_model_len": 512}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/collective_rpc":
                    state = {"version": None, "instance": "stub", "session_open": False}
                    return stub._json(self, {"results": [json.dumps(state)]})
                stub._stream(self, stub.scripts[min(stub.streams, len(stub.scripts) - 1)])

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"

    @staticmethod
    def _json(handler, body: dict) -> None:
        data = json.dumps(body).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _stream(self, handler, events: list[dict]) -> None:
        self.streams += 1
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        lines = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
        try:
            for k, line in enumerate(lines):
                if k == self.hold:
                    self.release.wait(timeout=5)
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client cut the stream
            pass
        handler.close_connection = True

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    server = StreamStub([token_event(t) for t in (11, 12, 13)] + [token_event(14, "length")])
    yield server
    server.close()


def one_segment(engine: ServerEngine):
    (segment,) = engine.generate_segments([SegmentRequest([1, 2], 7, 4)], SamplingParams(max_new_tokens=4, seed=0))
    return segment


def on_chunk(number: int, action):
    """The engine's chunk reader, doing ``action()`` in the segment's thread right after chunk ``number``."""
    read_chunk, seen = server_engine.read_chunk, []

    def reader(choice, address):
        out = read_chunk(choice, address)
        seen.append(out)
        if len(seen) == number:
            action()
        return out
    return mock.patch.object(server_engine, "read_chunk", reader)


def test_a_cut_keeps_its_tokens_when_the_sync_was_over_before_the_segment_saw_its_socket_fail(stub):
    """The cut socket fails as a cut (ABORTED), but the interrupt flag is already cleared when the segment looks:
    the tokens stay, the server is not blamed, the segment is not run again."""
    engine = ServerEngine([stub.address], pad_token_id=0, limits=LIMITS, stream=True)
    with on_chunk(2, lambda: (engine.interrupt(), engine.resume())):
        segment = one_segment(engine)
    assert (segment.tokens, segment.finish) == ([11, 12], "interrupted")
    assert segment.logprobs == pytest.approx([-0.11, -0.12])
    assert stub.streams == 1 and engine.pool.down == []
    engine.close()


def test_a_cut_keeps_its_tokens_whatever_error_the_socket_surfaces_as(stub):
    """The sync's interrupt comes while the stream stalls, its socket cut does not reach the stream (a connection
    the cut did not know) and the read then fails as a TIMEOUT, not as a cut: still a cut."""
    engine = ServerEngine([stub.address], pad_token_id=0, limits=replace(LIMITS, request_timeout_s=1.0), stream=True)
    stall = threading.Event()
    with on_chunk(2, stall.set), mock.patch.object(engine.pool.tracker(engine.pool.clients[0]), "cut", lambda: 0):
        threading.Thread(target=lambda: stall.wait(5) and engine.interrupt(), daemon=True).start()
        segment = one_segment(engine)
    assert (segment.tokens, segment.finish) == ([11, 12], "interrupted") and engine.pool.down == []
    engine.close()


def test_a_stream_the_cut_missed_ends_at_its_next_chunk(stub):
    """An interrupt between the segment's start and its connection (the socket cut reaches no stream): the stream
    stops at its first chunk, which it keeps, instead of running whole after the sync began."""
    engine = ServerEngine([stub.address], pad_token_id=0, limits=LIMITS, stream=True)
    acquire = engine.pool.acquire

    def acquire_then_interrupt():
        client = acquire()
        engine.interrupt()
        return client
    stub.release.set()
    with mock.patch.object(engine.pool, "acquire", acquire_then_interrupt):
        segment = one_segment(engine)
    assert (segment.tokens, segment.finish) == ([11], "interrupted") and engine.pool.down == []
    engine.close()


def test_a_5xx_mid_stream_without_an_interrupt_is_retried_and_one_during_the_backoff_starts_none(stub):
    broken = [token_event(11), ERROR_500]
    stub.scripts = [broken, [token_event(t) for t in (11, 12, 13)] + [token_event(14, "length")]]
    stub.release.set()
    engine = ServerEngine([stub.address], pad_token_id=0, limits=LIMITS, stream=True)
    segment = one_segment(engine)  # retried on its server (rollout.server.request_retries), the first try dropped
    assert (segment.tokens, segment.finish, stub.streams) == ([11, 12, 13, 14], "length", 2)
    assert engine.pool.down == []
    stub.streams = 0
    # the sync came in the backoff: the pool's own sleep interrupts (patching time.sleep itself would let any
    # thread of the process that sleeps, e.g. one left by an earlier test, interrupt the first attempt)
    backoff = SimpleNamespace(sleep=lambda s: engine.interrupt(), monotonic=time.monotonic)
    with mock.patch.object(server_pool, "time", backoff):
        segment = one_segment(engine)
    assert (segment.tokens, segment.finish, stub.streams) == ([], "interrupted", 1) and engine.pool.down == []
    engine.close()
