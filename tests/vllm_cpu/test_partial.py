"""Partial rollouts against a REAL vLLM CPU server (rollout.partial; docs/rollout.md, "Partial rollouts"):
a response cut by a weight sync goes on, token for token, as a fresh request from the same prefix with
the new weights and its segment's seed; every token keeps the version that sampled it; a training run
with partial rollouts cuts batches at its syncs and stays within max_staleness."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _servers import servers_override
from conftest import FP32_LOGPROB_BOUND, LANE_TOKEN
from test_train import train

from stapo.rollout import SamplingParams
from stapo.rollout.partial import PartialBatch, segment_seed
from stapo.rollout.server_engine import ServerEngine, outputs_from_completion
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
        assert (torch.tensor(sample.logprobs[n:]) - lp).abs().max() <= FP32_LOGPROB_BOUND
    rollout = batch.to_rollout(pad_token_id=0)
    assert rollout.token_version[rollout.response_mask].unique().tolist() == [100, 101]
    engine.close()


def test_a_partial_run_cuts_its_batches_at_the_syncs_and_stays_within_max_staleness(servers, tiny_model_dir,
                                                                                    tmp_path):
    for s in servers:
        s.ensure_running()
    steps = train(tmp_path / "partial", tiny_model_dir, "rollout.mode=server", servers_override(*servers),
                  "rollout.max_staleness=1", "rollout.partial=true", "trainer.total_steps=4",
                  "rollout.max_response_length=200", "trainer.save_every=0")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["policy_staleness"] <= 1 for r in steps) and steps[0]["policy_staleness"] == 0
    cut = [r for r in steps if r["partial_interrupted"] > 0]
    assert cut, "no sync cut a batch under way: generation did not outlast the update"
    for r in cut:  # a cut batch has tokens of two versions: its mean lag lies strictly between them
        assert 0 < r["policy_staleness_mean"] < 1, r
