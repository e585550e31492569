"""Faults of rollout servers, against stand-in servers (tests/rollout/_fake_server.py): what fails a
request and what fails a server, hangs found by the health watch, sessions that fail or were left open,
foreign models and secrets (docs/rollout.md, "Faults"). Real servers: tests/vllm_cpu/test_vllm_server_faults.py."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from _fake_server import DictWorker, FakeServer
from stapo.rollout import SamplingParams, generate
from stapo.servers.engine import ServerEngine, ServerLimits
from stapo.servers.pool import NoRolloutServers

FAST = ServerLimits(request_retries=1, down_after_s=1.0, health_interval_s=0.2, health_timeout_s=0.5,
                    sync_timeout_s=3.0)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)


@pytest.fixture
def fakes():
    made = []

    def make(**kw) -> FakeServer:
        made.append(FakeServer(**kw))
        return made[-1]
    yield make
    for server in made:
        server.close()


def engine_on(*servers: FakeServer, **kw) -> ServerEngine:
    return ServerEngine([s.address for s in servers], pad_token_id=0, limits=kw.pop("limits", FAST), **kw)


def test_a_request_error_fails_that_request_only(fakes, caplog):
    a = fakes()
    a.completion = lambda body: (400, {"error": "prompt too long"}) if len(body["prompt"]) > 3 else (200, a.good_reply(body))
    engine = engine_on(a)
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        r = generate(engine, [[1, 2], [1, 2, 3, 4, 5]], 2, SAMPLING)
    assert r.finish_reason == ["stop", "stop", "error", "error"]
    assert r.response_mask.sum(dim=1).tolist() == [2, 2, 0, 0] and r.sampling_logprobs[2:].eq(0).all()
    assert engine.pool.live == engine.pool.clients and engine.failed_requests == 2  # one request per sample
    assert f"a rollout request failed on {a.address} (rollout server {a.address}: HTTP 400" in caplog.text


@pytest.mark.parametrize("bad", ["not json", "short log-probs", "too few choices"])
def test_a_malformed_reply_is_the_servers_fault_and_names_it(bad, fakes, caplog):
    a, b = fakes(), fakes()

    def malformed(body):
        reply = a.good_reply(body)
        if bad == "not json":
            return 200, b"<html>proxy error</html>"
        if bad == "short log-probs":
            reply["choices"][0]["logprobs"]["token_logprobs"] = [-0.5]
        else:
            reply["choices"] = reply["choices"][:-1]
        return 200, reply
    a.completion = malformed
    engine = engine_on(a, b)
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        r = generate(engine, [[1, 2], [3, 4]], 2, SAMPLING)
    assert r.finish_reason == ["stop"] * 4  # every request answered, by b
    assert [c.address for c in engine.pool.down] == [a.address]
    assert f"rollout server {a.address} is down" in caplog.text
    assert f"rollout server {a.address}: attempt 1 of 2 failed" in caplog.text  # the retry is logged


def test_a_hung_server_is_declared_down_within_the_bound_and_its_requests_move(fakes, caplog):
    a, b = fakes(), fakes()

    def stop_answering(body):  # SIGSTOP-like from the first request on: connections accepted, nothing answered
        a.hang.set()
        while a.hang.is_set():
            time.sleep(0.05)
        return 200, a.good_reply(body)
    a.completion = stop_answering
    engine = engine_on(a, b)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        r = generate(engine, [[1], [2], [3], [4]], 1, SAMPLING)
    took = time.monotonic() - start
    assert r.finish_reason == ["stop"] * 4
    assert [c.address for c in engine.pool.down] == [a.address]
    assert "no answer on /health for" in caplog.text and "go elsewhere" in caplog.text
    # down after 1 s without a health answer, probes every 0.2 s lasting <= 0.5 s: well under the 600 s timeout
    assert took < FAST.down_after_s + 3.0, took
    engine.close()


def test_a_server_that_missed_a_sync_is_left_out_until_one_reaches_it(fakes):
    a, b = fakes(), fakes()
    engine = engine_on(a, b)
    engine.policy_version = 3  # the last sync gave version 3 ...
    a.version, b.version = 7, 3  # ... but a holds another one (restarted and synced by someone else)
    generate(engine, [[1]], 1, SAMPLING)
    assert [c.address for c in engine.pool.down] == [a.address]
    assert "holds policy version [7], not 3" in engine.pool.why_down()[a.address]
    a.version = 3
    generate(engine, [[1]], 1, SAMPLING)
    assert [c.address for c in engine.pool.down] == [a.address]  # state alone does not bring it back


def test_no_server_left_is_one_error_naming_each(fakes):
    a = fakes()
    a.completion = lambda body: (503, {"error": "engine dead"})
    engine = engine_on(a)
    with pytest.raises(NoRolloutServers, match=f"no rollout server is left: {a.address}: HTTP 503"):
        generate(engine, [[1]], 1, SAMPLING)


def test_the_secret_is_sent_and_its_absence_named(fakes):
    a = fakes(token="s3cret")
    with pytest.raises(ValueError, match=f"rollout server {a.address} needs the shared secret .* STAPO_SERVER_TOKEN"):
        engine_on(a)
    engine = engine_on(a, token="s3cret")
    assert generate(engine, [[1]], 1, SAMPLING).finish_reason == ["stop"]
    assert "s3cret" not in repr(engine.pool.clients[0])


def test_a_server_with_another_model_is_one_error_at_start(fakes, tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from stapo.serve.fingerprint import model_fingerprint, tokenizer_fingerprint

    config, tokenizer = AutoConfig.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = {"model": model_fingerprint(config, torch.float32), "tokenizer": tokenizer_fingerprint(tokenizer)}
    served = {"model": model_fingerprint(config, torch.bfloat16), "tokenizer": ours["tokenizer"]}
    a = fakes(fingerprint=served)
    with pytest.raises(ValueError, match=f"rollout server {a.address} does not serve the trainer's model: weight "
                                         "dtype: trainer float32, server bfloat16"):
        engine_on(a, fingerprint=ours)
    a.fingerprint = ours
    assert engine_on(a, fingerprint=ours).max_model_len == 512


def test_a_session_left_open_by_a_stopped_trainer_is_aborted_at_start(fakes, caplog):
    a = fakes()
    a.session_open = True
    engine_on(a, sends_weights=False)  # another rank: only rank 0 aborts (it is about to open its own)
    assert a.session_open
    with caplog.at_level(logging.WARNING, logger="stapo.rollout"):
        engine_on(a)
    assert not a.session_open and "was in the middle of a weight sync" in caplog.text


def test_a_failed_sync_is_reported_not_raised_and_leaves_no_session(fakes):
    """The join is refused: the sync fails fast (not after sync_timeout_s), every bucket the trainer's
    collective gathers still produce is dropped, the server is asked to abort, and ``last_sync`` says why."""
    a = fakes()
    engine = engine_on(a)
    for _ in range(2):  # a second sync opens a new session: nothing "already open"
        start = time.monotonic()
        with engine.weight_update(version=1):
            engine.load_weights([("w", torch.zeros(2))])
        assert time.monotonic() - start < FAST.sync_timeout_s
        assert not engine.last_sync.ok and "join refused" in engine.last_sync.error
        assert ("/collective_rpc", "stapo_abort_weight_update") in a.calls
        assert engine.policy_version is None
        engine.pool.mark_live(engine.pool.clients[0])


class SlowToJoin(DictWorker):
    def stapo_join_weight_group(self, spec: str) -> int:
        time.sleep(0.5)  # slower to check in than the other server's join is to fail
        return super().stapo_join_weight_group(spec)


def test_a_join_that_fails_at_once_does_not_take_a_slower_server_down_with_it(fakes):
    """A server lost just before a sync refuses its join at once; the other, still on its way to check in, is not
    named with it (the lane's fault suite once froze a trainer there and lost both servers), and the retry commits."""
    slow, lost = fakes(worker=SlowToJoin()), fakes()  # `lost` answers every join 500
    engine = engine_on(slow, lost)
    with engine.weight_update(version=1):
        engine.load_weights([("w", torch.ones(2))])
    assert not engine.last_sync.ok and engine.last_sync.failed == (lost.address,), engine.last_sync
    assert [c.address for c in engine.pool.live] == [slow.address]
    lost.close()  # gone for good (a server answering its state is tried again at every sync)
    with engine.weight_update(version=1):
        engine.load_weights([("w", torch.ones(2))])
    assert engine.last_sync.ok and torch.equal(slow.worker.weights["w"], torch.ones(2))


def test_request_time_limits_grow_with_the_tokens_asked_for():
    limits = ServerLimits(request_timeout_s=100.0, request_timeout_per_token_s=0.5)
    assert limits.request_timeout(0) == 100.0 and limits.request_timeout(15360) == 100.0 + 7680.0
