"""Partial rollouts against a REAL vLLM CPU server (rollout.partial; docs/rollout.md, "Partial rollouts"):
a response cut by a weight sync goes on, token for token, as a fresh request from the same prefix with
the new weights and its segment's seed; the trainer's producer cuts its batches at the syncs and every token
keeps the version that sampled it."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch
from _bounds import BATCH_NOISE, report
from conftest import HERE, LANE_TOKEN, run

from stapo.rollout import SamplingParams
from stapo.rollout.partial import PartialBatch, segment_seed
from stapo.rollout.server_completions import outputs_from_completion
from stapo.rollout.server_engine import ServerEngine
from stapo.rollout.vllm_engine import vllm_sampling_kwargs
from stapo.sync.buckets import sync_weights

pytestmark = pytest.mark.timeout(1800)


def test_a_response_cut_by_a_sync_continues_as_a_fresh_request_from_its_prefix(servers, tiny_model_dir, prompts):
    from transformers import AutoModelForCausalLM

    servers[0].ensure_running()
    engine = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)  # random: long answers
    sync_weights(model, engine, bucket_bytes=2**20, version=100)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=160, seed=9)
    seeds = vllm_sampling_kwargs(sampling, 2, len(prompts))[1]
    batch = PartialBatch.start(prompts, 2, sampling, seeds)
    result = []
    worker = threading.Thread(target=lambda: result.append(engine.generate_partial(batch, 100)))
    worker.start()
    while not all(s.tokens for s in batch.samples) and worker.is_alive():
        time.sleep(0.01)
    engine.interrupt()  # the sync starts: every segment in flight is cut
    worker.join(timeout=300)
    cut = [len(s.tokens) for s in batch.samples]
    assert result == [False] and batch.interrupted >= 1 and all(n > 0 for n in cut), cut
    with torch.no_grad():  # the update: new weights, version 101
        for p in model.parameters():
            p.mul_(1.02)
    sync_weights(model, engine, bucket_bytes=2**20, version=101)
    engine.resume()
    assert engine.generate_partial(batch, 101) is True
    base = vllm_sampling_kwargs(sampling, 1, 1)[0]
    for k, sample in enumerate(batch.samples):
        n = cut[k]
        if sample.segments < 2:  # finished before the cut: one segment, one version
            assert sample.versions == [100] * len(sample.tokens)
            continue
        assert sample.versions == [100] * n + [101] * (len(sample.tokens) - n)
        # the continuation, asked for directly: prompt + the kept prefix, the same seed, the new weights
        body = {**base, "prompt": sample.prompt + sample.tokens[:n], "n": 1, "return_token_ids": True,
                "max_tokens": sampling.max_new_tokens - n, "seed": segment_seed(sample.seed, 1)}
        direct = outputs_from_completion(engine.pool.clients[0].post("/v1/completions", body), 1).outputs[0]
        assert sample.tokens[n:] == list(direct.token_ids), k
        lp = torch.tensor([next(iter(e.values())) for e in direct.logprobs])
        moved = float((torch.tensor(sample.logprobs[n:]) - lp).abs().max())  # one request in two batches
        report(f"partial rollout {k}: continuation vs the same request alone, max |log-prob difference|", moved)
        assert moved <= BATCH_NOISE
    rollout = batch.to_rollout(pad_token_id=0)
    assert rollout.token_version[rollout.response_mask].unique().tolist() == [100, 101]
    engine.close()


def test_the_producer_cuts_batches_at_the_syncs_and_labels_every_token(servers, tiny_model_dir):
    """Four iterations of the trainer's producer (stand-in updates of 1 s): each sync cuts the batch under
    way, and every token's version is the one the server held when it was sampled — before the cut the
    version of the last sync, after it the new one — never more than max_staleness + 1 per response."""
    servers[0].ensure_running()
    proc = run([sys.executable, str(HERE / "_partial_producer.py"), servers[0].address, str(tiny_model_dir)])
    batches = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert batches[0]["interrupted"] == 0 and all(v == 0 for row in batches[0]["versions"] for v in row)
    assert sum(b["interrupted"] for b in batches[1:]) >= 2, [b["interrupted"] for b in batches]
    for step, batch in enumerate(batches[1:], start=1):
        # batch `step` started with version step - 1 (k = 1) and was cut by the sync that made version `step`
        for row in batch["versions"]:
            assert row == sorted(row) and set(row) <= {step - 1, step}, (step, row)
        assert batch["policy_version"] == min(v for row in batch["versions"] for v in row)
        if batch["interrupted"]:
            assert any(len(set(row)) == 2 for row in batch["versions"])  # a response spanning the sync
            assert all(f == "length" or f == "stop" for f in batch["finish"])
