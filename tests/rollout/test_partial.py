"""Partial rollouts (rollout.partial: stapo.rollout.drivers.Generation on an interruptible ServerEngine): a batch
cut by a weight sync keeps every token with its log-prob and version, and each sample goes on from prompt + its
tokens with its next segment's seed; a server fault re-runs the segment with the same seed, on the same server
while ``request_retries`` lasts (a 5xx mid-stream), then elsewhere. Stand-in servers stream a token per event
(tests/rollout/_fake_server.py); the real servers: tests/vllm_cpu/test_vllm_partial.py."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from _fake_server import FakeServer
from stapo.rollout import Generation, Rollout, SamplingParams, Segment
from stapo.rollout.sampling import derived_seed, vllm_request_kwargs
from stapo.rollout.trajectory import segment_seed
from stapo.servers.completions import completion_body
from stapo.servers.engine import ServerEngine, ServerLimits

LIMITS = ServerLimits(request_retries=0, down_after_s=5.0, health_interval_s=0.2, health_timeout_s=1.0)


def test_segment_zero_is_the_whole_prompt_requests_sample_and_later_segments_derive_their_seed():
    batch = Generation([[1, 2], [3]], 2, SamplingParams(max_new_tokens=5), seeds=[100, 200])
    assert [t.seed for t in batch.trajectories] == [100, 101, 200, 201]  # vLLM: sample i of a seed-p request is p + i
    base = vllm_request_kwargs(SamplingParams(max_new_tokens=5))
    sample = batch.trajectories[1]
    first = completion_body(sample.request(5), base)
    assert first["prompt"] == [1, 2] and first["n"] == 1 and first["seed"] == 101 and first["max_tokens"] == 5
    sample.add(Segment([7, 8], [-0.5, -0.25], "ab", "interrupted", version=3))
    second = completion_body(sample.request(5), base)
    assert second["prompt"] == [1, 2, 7, 8] and second["max_tokens"] == 3
    assert second["seed"] == derived_seed(101, 1) == segment_seed(101, 1) and segment_seed(101, 0) == 101
    assert segment_seed(None, 3) is None


def test_a_finished_batch_is_a_rollout_with_every_tokens_version():
    batch = Generation([[1], [2, 3]], 1, SamplingParams(max_new_tokens=5))
    a, b = batch.trajectories
    a.add(Segment([5, 6], [-1.0, -2.0], "x", "interrupted", version=4))
    a.add(Segment([7], [-3.0], "y", "stop", version=5))  # continued after the sync to version 5
    b.add(Segment([], [], "", "error", version=4))  # b's request was refused: no tokens
    a.finish, b.finish = "stop", "error"
    r = batch.rollout(pad_token_id=0)
    assert r.response_ids.tolist() == [[5, 6, 7], [0, 0, 0]] and r.response_text == ["xy", ""]
    assert r.token_version.tolist() == [[4, 4, 5], [0, 0, 0]]
    assert r.policy_version.tolist() == [4, 4]  # the oldest token's; a row without tokens: its start
    assert r.sampling_logprobs[0].tolist() == [-1.0, -2.0, -3.0] and r.finish_reason == ["stop", "error"]
    both = Rollout.concat([r, r.select([0]).with_policy_version(9)])
    assert both.token_version.tolist() == [[4, 4, 5], [0, 0, 0], [9, 9, 9]]
    assert r.select([0]).token_version.tolist() == [[4, 4, 5]]
    refused = Generation([[1]], 1, SamplingParams(max_new_tokens=5))  # no row has a token: each its start
    refused.trajectories[0].add(Segment([], [], "", "error", version=3))
    refused.trajectories[0].finish = "error"
    assert refused.rollout(pad_token_id=0).policy_version.tolist() == [3]


@pytest.fixture
def streaming():
    server = FakeServer()
    yield server
    server.close()


def _tokens(server: FakeServer, seed: int, start: int, count: int) -> list[int]:
    return [server.streamed_token(seed, p) for p in range(start, start + count)]


def _synced(engine: ServerEngine, server: FakeServer, version: int) -> None:
    """As if a weight sync had given the server policy ``version``."""
    engine.policy_version = server.version = version


def test_a_sync_cuts_the_segments_in_flight_and_they_go_on_from_their_tokens(streaming):
    streaming.stream_delay, streaming.stream_tokens = 0.15, 20
    engine = ServerEngine([streaming.address], pad_token_id=0, limits=LIMITS, stream=True)
    _synced(engine, streaming, 1)
    batch = Generation([[1, 2, 3]], 2, SamplingParams(max_new_tokens=8, seed=0), seeds=[40])
    done = []
    worker = threading.Thread(target=lambda: done.append(batch.advance(engine)))
    worker.start()
    while len(streaming.streamed) < 2:  # both streams under way ...
        time.sleep(0.02)
    time.sleep(0.5)  # ... for a few tokens each
    engine.interrupt()  # the sync starts
    worker.join(timeout=10)
    assert done == [False] and batch.interrupted == 2
    cut = [len(t.tokens) for t in batch.trajectories]
    assert all(0 < n < 8 for n in cut) and all(t.segments == 1 for t in batch.trajectories)
    assert batch.advance(engine) is False  # nothing starts until the sync is done
    _synced(engine, streaming, 2)
    engine.resume()
    streaming.stream_delay = 0.0
    assert batch.advance(engine) is True
    for seed, sample, n in zip((40, 41), batch.trajectories, cut):
        # segment 0 from the sample's seed, segment 1 from its derived seed, picking up at the cut
        assert sample.tokens == _tokens(streaming, seed, 0, n) + _tokens(streaming, derived_seed(seed, 1), 0, 8 - n)
        assert sample.versions == [1] * n + [2] * (8 - n) and sample.finish == "length"
    continued = [b for b in streaming.streamed if len(b["prompt"]) > 3]
    assert sorted(len(b["prompt"]) for b in continued) == sorted(3 + n for n in cut)
    assert all(b["max_tokens"] == 8 - (len(b["prompt"]) - 3) for b in continued)
    assert batch.rollout(pad_token_id=0).token_version[0].tolist() == [1] * cut[0] + [2] * (8 - cut[0])
    engine.close()


def _broken_stream(server: FakeServer, event: bytes, once: bool = False):
    """Replace ``server``'s streams by one real token then ``event`` (the first stream only, with ``once``)."""
    good = server._stream

    def stream(handler, body):
        if once and len(server.streamed) > 0:
            return good(handler, body)
        server.streamed.append(body)
        handler.send_response(200)
        handler.end_headers()
        handler.wfile.write(b'data: {"choices": [{"index": 0, "token_ids": [11], "text": "", '
                            b'"logprobs": {"token_logprobs": [-0.1]}, "finish_reason": null}]}\n\n')
        handler.wfile.write(event)
    server._stream = stream


def test_a_server_fault_reruns_the_segment_with_the_same_seed_elsewhere():
    good, bad = FakeServer(), FakeServer()
    try:
        _broken_stream(bad, b"data: [DONE]\n\n")  # the stream ends without a finish reason: malformed
        engine = ServerEngine([bad.address, good.address], pad_token_id=0, limits=LIMITS, stream=True)
        batch = Generation([[1]], 1, SamplingParams(max_new_tokens=6, seed=0), seeds=[7])
        assert batch.advance(engine)
        sample = batch.trajectories[0]
        assert bad.streamed and sample.tokens == _tokens(good, 7, 0, 6)  # bad's token was dropped, same seed
        assert sample.segments == 1 and [c.address for c in engine.pool.down] == [bad.address]
    finally:
        good.close()
        bad.close()


def test_a_5xx_mid_stream_is_retried_on_the_same_server_not_marked_down(streaming, caplog):
    """rollout.server.request_retries holds for streamed segments as for whole requests (ServerPool.run)."""
    error = {"error": {"object": "error", "message": "engine step failed", "type": "InternalServerError", "code": 500}}
    _broken_stream(streaming, b"data: " + json.dumps(error).encode() + b"\n\n", once=True)
    engine = ServerEngine([streaming.address], pad_token_id=0, stream=True,
                          limits=ServerLimits(request_retries=1, health_interval_s=0.2, health_timeout_s=1.0))
    batch = Generation([[1, 2]], 1, SamplingParams(max_new_tokens=5, seed=0), seeds=[9])
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        assert batch.advance(engine)
    assert len(streaming.streamed) == 2 and streaming.streamed[0]["seed"] == streaming.streamed[1]["seed"] == 9
    assert batch.trajectories[0].tokens == _tokens(streaming, 9, 0, 5)  # the failed attempt's token is dropped
    assert engine.pool.down == [] and f"rollout server {streaming.address}: attempt 1 of 2 failed" in caplog.text
    assert "streamed an error" in caplog.text and "is down" not in caplog.text
    engine.close()


def test_partial_rollouts_of_tool_episodes_are_a_valid_setting():
    from stapo.config import STAPOConfig

    cfg = STAPOConfig.from_yaml(None, ["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:8000]", "rollout.partial=true",
                                       "rollout.max_staleness=1", "rollout.tools.enabled=true",
                                       "rollout.tools.names=[calculator]"])
    assert cfg.rollout.partial and cfg.rollout.tools.enabled
