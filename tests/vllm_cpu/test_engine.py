"""VLLMEngine against the real vLLM: sampling logprobs equal the trainer's teacher-forced recompute,
per-request seeds reproduce, and ONE weight-update session with buckets that split fused layers
leaves vLLM exactly on the trainer's weights (issue: rollouts that reproduce, one update path)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from _bounds import BATCH_NOISE, assert_fp32_noise, report
from conftest import FP32_LOGPROB_BOUND, HERE, run

from stapo.rollout import Generation, SamplingParams, VLLMEngine, generate
from stapo.rollout.sampling import vllm_request_kwargs

sys.path.insert(0, str(HERE.parent / "rollout"))
from _rollout_utils import assert_matches_teacher_forced  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One standalone engine for the module (vLLM runs its engine core in a child process here)."""
    engine = VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=256, enforce_eager=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def perturbed(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``model`` moved by half its std (named_parameters: tied weights appear once)."""
    gen = torch.Generator().manual_seed(seed)
    return [(n, (p + 0.5 * p.std() * torch.randn(p.shape, generator=gen)).detach())
            for n, p in model.named_parameters()]


def sync_in_buckets(engine, named, size: int = 3) -> None:
    """One update session, buckets of ``size`` tensors: q/k/v and gate/up land in different buckets."""
    with engine.weight_update():
        for start in range(0, len(named), size):
            engine.load_weights(named[start: start + size])


def test_generate_matches_the_trainers_teacher_forced_logprobs(engine, hf_model, prompts):
    r = generate(engine, prompts, 4, SamplingParams(temperature=0.8, top_k=20, max_new_tokens=16, seed=0))
    assert len(r) == 12 and r.group_index.tolist() == [i // 4 for i in range(12)]
    for i in range(12):
        assert r.prompt_ids[i, -len(prompts[i // 4]):].tolist() == prompts[i // 4]
    assert_matches_teacher_forced(hf_model, r, atol=FP32_LOGPROB_BOUND, temperature=0.8, top_k=20)


def test_requests_carry_their_own_seeds(engine, prompts):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11)
    first = generate(engine, prompts, 4, sampling).response_ids
    assert torch.equal(first, generate(engine, prompts, 4, sampling).response_ids)  # same seed, same rollout
    other = generate(engine, prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16, seed=12))
    assert not torch.equal(first, other.response_ids)
    # a prompt's samples depend on its own seed only: the first prompt alone samples the same rows
    alone = generate(engine, prompts[:1], 4, sampling).response_ids
    assert torch.equal(alone[:, :first.shape[1]], first[:4, :alone.shape[1]])


def test_several_calls_in_one_submission_sample_what_they_sample_alone(engine, prompts):
    """stapo eval's chunks in one vLLM submission (one generate_segments call): the same rows as call by call."""
    calls = [(prompts[:2], 3, SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)),
             (prompts[2:], 2, SamplingParams(temperature=1.0, max_new_tokens=12, seed=6))]
    requests = [t.request(sampling.max_new_tokens) for p, n, sampling in calls
                for t in Generation(p, n, sampling).trajectories]
    together = engine.generate_segments(requests, calls[0][2])
    alone = [s for p, n, sampling in calls for s in engine.generate_segments(
        [t.request(sampling.max_new_tokens) for t in Generation(p, n, sampling).trajectories], sampling)]
    assert len(together) == 6 + 2
    for merged, single in zip(together, alone, strict=True):
        assert merged.tokens == single.tokens and merged.finish == single.finish
        # the same tokens; the log-probs of one request in two batches (bit-equal on the EPYC the bounds were
        # measured on, but vLLM's kernels need not be batch-invariant on every CPU, and are not on a GPU)
        moved = max((abs(x - y) for x, y in zip(merged.logprobs, single.logprobs)), default=0.0)
        report("one call merged with another vs alone: max |log-prob difference|", moved)
        assert moved <= BATCH_NOISE


def test_n_seeded_one_sample_requests_sample_what_one_n_sample_request_does(engine, prompts):
    """vLLM gives the k-th of an n-sample request seeded s the seed s + k: the rule stapo's seed scheme rests
    on (a sample's seed is its prompt's + k, each sample one request)."""
    import vllm

    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    base = {**vllm_request_kwargs(sampling), "max_tokens": 16}
    requests = [{"prompt_token_ids": prompts[1]}]
    one = engine.llm.generate(requests, vllm.SamplingParams(**{**base, "n": 4}, seed=1234), use_tqdm=False)[0]
    each = engine.llm.generate(requests * 4, [vllm.SamplingParams(**base, seed=1234 + k) for k in range(4)],
                               use_tqdm=False)
    fanned = [list(c.token_ids) for c in sorted(one.outputs, key=lambda c: c.index)]
    assert fanned == [list(out.outputs[0].token_ids) for out in each]
    assert len({tuple(t) for t in fanned}) > 1  # four different samples


def test_sync_in_split_buckets_puts_vllm_exactly_on_the_new_weights(engine, hf_model, prompts):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = generate(engine, prompts, 1, greedy).response_ids
    original = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]
    new = perturbed(hf_model, seed=0)
    sync_in_buckets(engine, new)
    with torch.no_grad():
        for (_, p), (_, t) in zip(hf_model.named_parameters(), new):
            p.copy_(t)
    try:
        r = generate(engine, prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
        # the output layer too: Qwen3's tied lm_head is reprocessed (stapo.serve.worker_extension.reprocess_tied_layers)
        assert_matches_teacher_forced(hf_model, r, atol=FP32_LOGPROB_BOUND, temperature=1.0)
    finally:
        sync_in_buckets(engine, original, size=5)
        with torch.no_grad():
            for (_, p), (_, t) in zip(hf_model.named_parameters(), original):
                p.copy_(t)
    assert torch.equal(generate(engine, prompts, 1, greedy).response_ids, before)  # restored exactly


def test_load_weights_outside_an_update_session_is_refused(engine, hf_model):
    with pytest.raises(RuntimeError, match="weight_update"):
        engine.load_weights([("model.norm.weight", hf_model.model.norm.weight.detach())])


def test_engine_inside_the_trainers_one_rank_group(tiny_model_dir):
    """In process (external launcher): env restored, caller RNGs untouched, sync exact, seeds reproduce."""
    proc = run([sys.executable, str(HERE / "_engine_in_group.py"), str(tiny_model_dir)], timeout=900)
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert result["in_process"] is True
    assert result["rank_left_set"] is False and result["launched"] is False
    assert result["caller_rngs_untouched_by_build"] is True
    report("engine in the trainer's group, perturbed weights synced: mismatch max", result["perturbed_max_abs_diff"])
    assert_fp32_noise(result["perturbed_max_abs_diff"], "engine in the trainer's group, after a sync")
    assert result["restored"] and result["seed_reproduces"] and result["caller_rngs_untouched_by_generate"]
    if torch.cuda.is_available():  # sleep mode exists on CUDA only: it must free memory there
        assert result["freed_fraction"] > 0.1, result
        assert result["level2_refused"] and result["level2_restored"], result  # rollout.sleep_level 2
