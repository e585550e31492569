"""Partial rollouts against a REAL vLLM CPU server (rollout.partial; docs/rollout.md, "Partial rollouts"):
a response cut by a weight sync goes on, token for token, as a fresh request from the same prefix with
the new weights and its segment's seed — a one-turn response and a tool episode alike; the trainer's producer
cuts its batches at the syncs and every token keeps the version that sampled it."""

from __future__ import annotations

import copy
import json
import sys
import threading
from unittest import mock

import pytest
import torch
from _bounds import BATCH_NOISE, report
from conftest import HERE, LANE_TOKEN, run

from stapo.rollout import Generation, SamplingParams, SegmentRequest
from stapo.rollout.sampling import vllm_request_kwargs
from stapo.rollout.trajectory import segment_seed
from stapo.servers.completions import completion_body, segment_from_reply
import stapo.servers.engine as server_engine
from stapo.servers.engine import ServerEngine
from stapo.sync.buckets import sync_weights

pytestmark = pytest.mark.timeout(1800)


def _cut_by_a_sync(engine: ServerEngine, new_batch, model, version: int) -> tuple[Generation, list]:
    """A batch (``new_batch()``) advanced until a weight sync cuts segments that produced tokens, then
    ``model``'s weights moved by 2% and synced as ``version``. Returns the batch and its trajectories as the cut
    left them. The sync starts right when a streamed segment holds tokens and has not finished, from the engine's
    chunk reader itself: a sync started from another thread once it saw such a chunk (or after a fixed delay)
    missed the window on a loaded machine, where tool turns' segments are short and their tokens come in bursts.
    Tried again, with a fresh batch when one finished first (no chunk before its last)."""
    armed, read_chunk = threading.Event(), server_engine.read_chunk

    def watched(choice, address):
        ids, logprobs, text, finish = read_chunk(choice, address)
        if ids and finish is None and armed.is_set():
            armed.clear()
            engine.interrupt()  # the sync starts: every segment in flight is cut, this one after this chunk
        return ids, logprobs, text, finish

    batch, tries = new_batch(), []
    with mock.patch.object(server_engine, "read_chunk", watched):
        for _ in range(30):
            armed.set()
            result = [batch.advance(engine)]
            tries.append((result[:], batch.interrupted, sum(t.done for t in batch.trajectories)))
            if batch.interrupted and result == [False]:
                break
            armed.clear()
            engine.resume()
            if result == [True]:  # finished first (a cut can also land on a segment's last token): a fresh batch
                batch = new_batch()
    assert result == [False] and batch.interrupted >= 1, tries  # (result, segments cut, samples done)
    cut = copy.deepcopy(batch.trajectories)
    with torch.no_grad():  # the update: new weights
        for p in model.parameters():
            p.mul_(1.02)
    sync_weights(model, engine, bucket_bytes=2**20, version=version)
    engine.resume()
    return batch, cut


def test_a_response_cut_by_a_sync_continues_as_a_fresh_request_from_its_prefix(servers, tiny_model_dir, prompts):
    from transformers import AutoModelForCausalLM

    servers[0].ensure_running()
    engine = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN, stream=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)  # random: long answers
    sync_weights(model, engine, bucket_bytes=2**20, version=100)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=160, seed=9)
    batch, cut_at = _cut_by_a_sync(engine, lambda: Generation(prompts, 2, sampling), model, 101)
    assert batch.advance(engine) is True
    base = vllm_request_kwargs(sampling)
    for k, (sample, before) in enumerate(zip(batch.trajectories, cut_at)):
        n = len(before.tokens)
        if before.done:  # finished before the cut: one segment, one version
            assert sample.versions == [100] * len(sample.tokens)
            continue
        assert sample.versions == [100] * n + [101] * (len(sample.tokens) - n)
        # the continuation, asked for directly: prompt + the kept prefix, the same seed, the new weights
        request = SegmentRequest(sample.prompt + sample.tokens[:n], segment_seed(sample.seed, before.segments),
                                 sampling.max_new_tokens - n)
        direct = segment_from_reply(engine.pool.clients[0].post("/v1/completions", completion_body(request, base)))
        assert sample.tokens[n:] == direct.tokens, k
        moved = float((torch.tensor(sample.logprobs[n:]) - torch.tensor(direct.logprobs)).abs().max())
        report(f"partial rollout {k}: continuation vs the same request alone, max |log-prob difference|", moved)
        assert moved <= BATCH_NOISE  # one request in two batches
    rollout = batch.rollout(pad_token_id=0)
    assert rollout.token_version[rollout.response_mask].unique().tolist() == [100, 101]
    engine.close()


def test_a_tool_episode_cut_by_a_sync_continues_as_the_same_episode_from_its_prefix(servers, warm_model_dir):
    """The lane's calculator episodes (tests/vllm_cpu/test_vllm_episodes.py) on a streaming server, cut by a sync in
    the middle of their turns: the cut turn goes on token for token as one request from the same prefix with
    the new weights and the segment's seed, and the whole rest of each episode is what an uncut driver run from
    the cut state gives with plain (unstreamed) requests."""
    from test_vllm_episodes import lane_tools
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo.tiny import CHAT_INSTRUCTION, arithmetic_problems

    servers[0].ensure_running()
    tokenizer = AutoTokenizer.from_pretrained(str(warm_model_dir))
    chains = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": f"{p.question} {CHAT_INSTRUCTION}"}],
                                                      tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"] for p in arithmetic_problems(4, seed=21, terms=5)]
    engine = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN, stream=True)
    model = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    sync_weights(model, engine, bucket_bytes=2**20, version=200)
    tools = lane_tools(tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48, seed=11)
    batch, cut_at = _cut_by_a_sync(engine, lambda: Generation(chains, 2, sampling, tools=tools), model, 201)
    uncut = Generation(chains, 2, sampling, tools=tools)  # the same episodes from the cut state, no more cuts
    uncut.trajectories = copy.deepcopy(cut_at)
    plain = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN)  # whole requests
    assert batch.advance(engine) is True and uncut.advance(plain) is True
    mid_turn = 0
    base = vllm_request_kwargs(tools.sampling(sampling))
    for k, (sample, before, again) in enumerate(zip(batch.trajectories, cut_at, uncut.trajectories)):
        assert sample.tokens == again.tokens and sample.sampled == again.sampled, k  # the rest of the episode
        moved = float((torch.tensor(sample.logprobs) - torch.tensor(again.logprobs)).abs().max())
        report(f"tool episode {k} cut by a sync vs continued in one request: max |log-prob difference|", moved)
        assert moved <= BATCH_NOISE  # the same requests in other batches
        assert sample.texts == again.texts and sample.finish == again.finish and sample.calls == again.calls
        if before.done or not before.turn_text:
            continue
        mid_turn += 1  # cut inside a turn: its next segment, asked for directly, goes on from the prefix
        n = len(before.tokens)
        request = SegmentRequest(sample.prompt + sample.tokens[:n], segment_seed(sample.seed, before.segments),
                                 sampling.max_new_tokens - n)
        direct = segment_from_reply(plain.pool.clients[0].post("/v1/completions", completion_body(request, base)))
        assert sample.tokens[n: n + len(direct.tokens)] == direct.tokens, k
        sampled = [v for v, s in zip(sample.versions, sample.sampled) if s]  # context tokens have none
        assert set(sampled[:sum(before.sampled)]) == {200} and set(sampled[sum(before.sampled):]) <= {201}
    assert mid_turn >= 1 and any(t.calls for t in batch.trajectories)
    rollout = batch.rollout(pad_token_id=0)
    assert rollout.context_mask.any() and rollout.token_version[rollout.response_mask].unique().tolist() == [200, 201]
    engine.close()
    plain.close()


def test_the_producer_cuts_batches_at_the_syncs_and_labels_every_token(servers, tiny_model_dir):
    """Four iterations of the trainer's producer (stand-in updates of 1 s): each sync cuts the batch under
    way, and every token's version is the one the server held when it was sampled — before the cut the
    version of the last sync, after it the new one — never more than max_staleness + 1 per response."""
    servers[0].ensure_running()
    proc = run([sys.executable, str(HERE / "_partial_producer.py"), servers[0].address, str(tiny_model_dir)])
    batches = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert batches[0]["interrupted"] == 0 and all(v == 0 for row in batches[0]["versions"] for v in row)
    # each sync waits until the next batch streams, yet a loaded rehearsal once saw 1 cut of 3 ([0, 1, 0, 0]; cause
    # not found): at least one cut, and every batch's labels below, whichever batches were cut
    assert sum(b["interrupted"] for b in batches[1:]) >= 1, [b["interrupted"] for b in batches]
    for step, batch in enumerate(batches[1:], start=1):
        # batch `step` started with version step - 1 (k = 1) and was cut by the sync that made version `step`
        for row in batch["versions"]:
            assert row == sorted(row) and set(row) <= {step - 1, step}, (step, row)
        assert batch["policy_version"] == min(v for row in batch["versions"] for v in row)
        if batch["interrupted"]:
            assert any(len(set(row)) == 2 for row in batch["versions"])  # a response spanning the sync
            assert all(f == "length" or f == "stop" for f in batch["finish"])
