"""Partial rollouts (stapo.rollout.partial, stapo.rollout.server_partial): a batch cut by a weight sync
keeps every token with its log-prob and version, and each sample goes on from prompt + its tokens with
its next segment's seed; a server fault re-runs the segment with the same seed. Stand-in servers stream
a token per event (tests/rollout/_fake_server.py); the real servers: tests/vllm_cpu/test_partial.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from _fake_server import FakeServer
from stapo.rollout import Rollout, SamplingParams
from stapo.rollout.partial import PartialBatch, segment_seed
from stapo.rollout.sampling import derived_seed
from stapo.rollout.server_engine import ServerEngine, ServerLimits

LIMITS = ServerLimits(request_retries=0, server_down_after_s=5.0, health_interval_s=0.2, health_timeout_s=1.0)


def test_segment_zero_is_the_whole_prompt_requests_sample_and_later_segments_derive_their_seed():
    batch = PartialBatch.start([[1, 2], [3]], 2, SamplingParams(max_new_tokens=5), prompt_seeds=[100, 200])
    assert [s.seed for s in batch.samples] == [100, 101, 200, 201]  # vLLM: sample i of a seed-p request is p + i
    base = {"temperature": 1.0, "max_tokens": 5, "logprobs": 0}
    first = batch.request(1, base)
    assert first["prompt"] == [1, 2] and first["n"] == 1 and first["seed"] == 101 and first["max_tokens"] == 5
    batch.samples[1].add([7, 8], [-0.5, -0.25], "ab", version=3)
    batch.samples[1].segments = 1
    second = batch.request(1, base)
    assert second["prompt"] == [1, 2, 7, 8] and second["max_tokens"] == 3
    assert second["seed"] == derived_seed(101, 1) == segment_seed(101, 1) and segment_seed(101, 0) == 101
    assert segment_seed(None, 3) is None


def test_a_finished_batch_is_a_rollout_with_every_tokens_version():
    batch = PartialBatch.start([[1], [2, 3]], 1, SamplingParams(max_new_tokens=4), prompt_seeds=None)
    a, b = batch.samples
    a.first_version = b.first_version = 4
    a.add([5, 6], [-1.0, -2.0], "x", version=4)
    a.add([7], [-3.0], "y", version=5)  # continued after the sync to version 5
    a.finish_reason, b.finish_reason = "stop", "error"  # b's request was refused: no tokens
    r = batch.to_rollout(pad_token_id=0)
    assert r.response_ids.tolist() == [[5, 6, 7], [0, 0, 0]] and r.response_text == ["xy", ""]
    assert r.token_version.tolist() == [[4, 4, 5], [0, 0, 0]]
    assert r.policy_version.tolist() == [4, 4]  # the oldest token's; a row without tokens: its start
    assert r.sampling_logprobs[0].tolist() == [-1.0, -2.0, -3.0] and r.finish_reason == ["stop", "error"]
    both = Rollout.concat([r, r.select([0]).with_policy_version(9)])
    assert both.token_version.tolist() == [[4, 4, 5], [0, 0, 0], [9, 9, 9]]
    assert r.select([0]).token_versions().tolist() == [[4, 4, 5]]


@pytest.fixture
def streaming():
    server = FakeServer()
    yield server
    server.close()


def _tokens(server: FakeServer, seed: int, start: int, count: int) -> list[int]:
    return [server.streamed_token(seed, p) for p in range(start, start + count)]


def test_a_sync_cuts_the_segments_in_flight_and_they_go_on_from_their_tokens(streaming):
    streaming.stream_delay, streaming.stream_tokens = 0.15, 20
    engine = ServerEngine([streaming.address], pad_token_id=0, limits=LIMITS)
    batch = PartialBatch.start([[1, 2, 3]], 2, SamplingParams(max_new_tokens=8, seed=0), prompt_seeds=[40])
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate_partial(batch, version=1)))
    worker.start()
    while not all(s.tokens for s in batch.samples):  # both streams under way
        time.sleep(0.02)
    engine.interrupt()  # the sync starts
    worker.join(timeout=10)
    assert done == [False] and batch.interrupted == 2
    cut = [len(s.tokens) for s in batch.samples]
    assert all(0 < n < 8 for n in cut) and all(s.segments == 1 for s in batch.samples)
    assert engine.generate_partial(batch, version=2) is False  # nothing starts until the sync is done
    engine.resume()
    streaming.stream_delay = 0.0
    assert engine.generate_partial(batch, version=2) is True
    for seed, sample, n in zip((40, 41), batch.samples, cut):
        # segment 0 from the sample's seed, segment 1 from its derived seed, picking up at the cut
        assert sample.tokens == _tokens(streaming, seed, 0, n) + _tokens(streaming, derived_seed(seed, 1), 0, 8 - n)
        assert sample.versions == [1] * n + [2] * (8 - n) and sample.finish_reason == "length"
    continued = [b for b in streaming.streamed if len(b["prompt"]) > 3]
    assert sorted(len(b["prompt"]) for b in continued) == sorted(3 + n for n in cut)
    assert all(b["max_tokens"] == 8 - (len(b["prompt"]) - 3) for b in continued)
    engine.close()


def test_a_server_fault_reruns_the_segment_with_the_same_seed_elsewhere():
    good, bad = FakeServer(), FakeServer()
    try:
        bad.stream_tokens = 2  # then the stream ends without a finish reason: malformed
        original = bad._stream

        def broken(handler, body):
            bad.streamed.append(body)
            handler.send_response(200)
            handler.end_headers()
            handler.wfile.write(b'data: {"choices": [{"index": 0, "token_ids": [11], "text": "", '
                                b'"logprobs": {"token_logprobs": [-0.1]}, "finish_reason": null}]}\n\n')
            handler.wfile.write(b"data: [DONE]\n\n")
        bad._stream = broken
        engine = ServerEngine([bad.address, good.address], pad_token_id=0, limits=LIMITS)
        batch = PartialBatch.start([[1]], 1, SamplingParams(max_new_tokens=6, seed=0), prompt_seeds=[7])
        assert engine.generate_partial(batch, version=0)
        sample = batch.samples[0]
        assert bad.streamed and sample.tokens == _tokens(good, 7, 0, 6)  # bad's token was dropped, same seed
        assert sample.segments == 1 and [c.address for c in engine.pool.down] == [bad.address]
        del original
    finally:
        good.close()
        bad.close()
