"""HFEngine on the tiny Qwen3 model (through the one-turn driver): layout, stopping, determinism, per-request
seeds and limits, one prefill per distinct context, and logprobs that match a teacher-forced forward (through
the trainer's padded inputs builder, which also checks the positions)."""

from __future__ import annotations

import pytest
import torch
from _rollout_utils import assert_matches_teacher_forced, teacher_forced, teacher_forced_logits

from stapo.rollout import HFEngine, RolloutEngine, SamplingParams, SegmentRequest, generate
from stapo.rollout.trajectory import prompt_seeds

G = 2


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> HFEngine:
    return HFEngine(tiny_model_path)


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.eos_token_ids == [engine.tokenizer.eos_token_id]
    assert not engine.model.training


def test_layout_and_masks(engine, prompts):
    r = generate(engine, prompts, G, SamplingParams(max_new_tokens=8, seed=0))
    b = len(prompts) * G
    assert len(r) == b and r.group_size == G and r.num_prompts == len(prompts)
    assert r.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    for i in range(b):  # row i answers prompt i // G, left-padded
        p = prompts[i // G]
        assert r.prompt_ids[i, -len(p):].tolist() == p and int(r.prompt_mask[i].sum()) == len(p)
        assert (r.prompt_ids[i][~r.prompt_mask[i]] == engine.pad_token_id).all()
    n = r.response_lengths
    # response_mask is a prefix; padding holds the pad id and logprob 0
    assert torch.equal(r.response_mask, torch.arange(r.response_ids.shape[1]) < n[:, None])
    assert (r.response_ids[~r.response_mask] == engine.pad_token_id).all()
    assert (r.sampling_logprobs[r.response_mask] <= 0).all()
    for i in range(b):
        last = int(r.response_ids[i, n[i] - 1])
        assert r.finish_reason[i] == ("stop" if last in engine.eos_token_ids else "length")
        if r.finish_reason[i] == "length":
            assert n[i] == 8
    assert r.response_text[0] == engine.tokenizer.decode(r.response_ids[0, : n[0]], skip_special_tokens=True)
    assert r.ground_truth == [] and r.prompt_text == []


def test_same_seed_same_tokens_independent_of_global_rng(engine, prompts):
    sp = SamplingParams(max_new_tokens=6, seed=3)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = generate(engine, prompts, G, sp)
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched
    torch.manual_seed(999)
    b = generate(engine, prompts, G, sp)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.sampling_logprobs, b.sampling_logprobs)
    c = generate(engine, prompts, G, SamplingParams(max_new_tokens=6, seed=4))
    assert not torch.equal(a.response_ids, c.response_ids)
    # the G samples of one prompt are different draws
    assert not torch.equal(a.response_ids[0], a.response_ids[1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(engine, prompts, temperature):
    r = generate(engine, prompts, G, SamplingParams(temperature=temperature, max_new_tokens=10, seed=1))
    assert_matches_teacher_forced(engine.model, r, temperature=temperature)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (-1, 0.5), (8, 0.7)])
def test_top_k_top_p_logprobs_are_renormalized(engine, prompts, top_k, top_p):
    sp = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=2)
    r = generate(engine, prompts, G, sp)
    assert_matches_teacher_forced(engine.model, r, top_k=top_k, top_p=top_p)
    raw = teacher_forced(engine.model, r)  # plain temperature-1 logprobs of the same tokens
    valid = r.response_mask
    # renormalizing over a subset raises every kept token's probability
    assert (r.sampling_logprobs[valid] >= raw[valid] - 1e-5).all()
    assert (r.sampling_logprobs[valid] > raw[valid] + 1e-3).any()


def test_greedy_follows_argmax(engine, prompts):
    r = generate(engine, prompts, G, SamplingParams(temperature=0.0, max_new_tokens=6))
    assert torch.equal(r.response_ids[0], r.response_ids[1])  # greedy: both samples equal
    argmax = teacher_forced_logits(engine.model, r).argmax(-1)
    assert torch.equal(argmax[r.response_mask], r.response_ids[r.response_mask])


def test_stop_token_ends_row_and_masks_the_rest(engine, prompts):
    greedy = generate(engine, prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    seq = greedy.response_ids[0].tolist()
    stop = seq[3]
    first = seq.index(stop)  # greedy decoding reproduces seq up to the first stop token
    r = generate(engine, prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    assert r.finish_reason == ["stop"]
    assert r.response_ids[0].tolist() == seq[: first + 1]  # the stop token is kept, nothing after
    assert int(r.response_lengths[0]) == first + 1 and r.response_mask[0].all()


def test_rows_finishing_early_leave_the_others_intact(engine, prompts):
    # 40 of 344 ids stop a row: rows end at different steps, so finished rows are dropped from the
    # batch and KV cache mid-generation while the others keep decoding
    sp = SamplingParams(max_new_tokens=16, seed=0, stop_token_ids=tuple(range(100, 140)))
    r = generate(engine, prompts, 4, sp)
    stop_lengths = {int(n) for n, f in zip(r.response_lengths, r.finish_reason, strict=True) if f == "stop"}
    assert len(stop_lengths) >= 2 and "length" in r.finish_reason
    for i, reason in enumerate(r.finish_reason):
        last = int(r.response_ids[i, r.response_lengths[i] - 1])
        assert (reason == "stop") == (100 <= last < 140)
    assert_matches_teacher_forced(engine.model, r)


def test_max_tokens_truncation_is_flagged_length(engine, prompts):
    r = generate(engine, prompts, G, SamplingParams(max_new_tokens=3, seed=5))
    assert r.response_ids.shape[1] <= 3
    length_rows = [i for i, f in enumerate(r.finish_reason) if f == "length"]
    assert length_rows  # EOS in 3 steps of a random 344-token model is rare
    for i in length_rows:
        assert int(r.response_lengths[i]) == 3
        assert int(r.response_ids[i, 2]) not in engine.eos_token_ids


def test_chunked_batches_keep_groups(engine, tiny_model_path, prompts):
    small = HFEngine(tiny_model_path, max_batch_size=3)  # chunks of 3 rows: a group split across two
    r = generate(small, prompts, G, SamplingParams(max_new_tokens=5, seed=0))
    assert r.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    for i in range(len(r)):
        p = prompts[i // G]
        assert r.prompt_ids[i, -len(p):].tolist() == p
    assert_matches_teacher_forced(small.model, r)
    # each row draws from its own seed: the chunking changes nothing
    assert torch.equal(r.response_ids, generate(engine, prompts, G, SamplingParams(max_new_tokens=5, seed=0)).response_ids)


def test_load_weights_changes_outputs_and_matches_new_weights(tiny_model_path, prompts):
    from transformers import AutoModelForCausalLM

    engine = HFEngine(tiny_model_path)
    sp = SamplingParams(max_new_tokens=8, seed=11)
    before = generate(engine, prompts, G, sp)
    # the "trainer" copy: same checkpoint, perturbed, pushed in buckets of 5 tensors
    trained = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    named = list(trained.state_dict().items())
    for start in range(0, len(named), 5):
        engine.load_weights(named[start: start + 5])
    after = generate(engine, prompts, G, sp)
    assert not torch.equal(before.response_ids, after.response_ids)
    assert_matches_teacher_forced(trained, after)


def test_load_weights_errors_and_tied_alias(tiny_model_path):
    engine = HFEngine(tiny_model_path)
    with pytest.raises(KeyError, match="model.nope.weight"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    embed = engine.model.get_input_embeddings().weight
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
    assert engine.model.config.tie_word_embeddings
    engine.load_weights([("lm_head.weight", torch.ones_like(embed))])  # tied: writes the embedding too
    assert (engine.model.get_input_embeddings().weight == 1).all()
    assert (engine.model.get_output_embeddings().weight == 1).all()


def test_bad_inputs(engine, prompts):
    with pytest.raises(ValueError, match="empty"):
        generate(engine, [prompts[0], []], G, SamplingParams())
    with pytest.raises(ValueError, match="n"):
        generate(engine, prompts, 0, SamplingParams())
    with pytest.raises(TypeError, match="token-id sequences"):
        generate(engine, [{"input_ids": [1, 2]}], G, SamplingParams())
    with pytest.raises(TypeError, match="PreTrainedModel"):
        HFEngine(torch.nn.Linear(2, 2))


def test_each_request_draws_from_its_own_seed(engine, prompts):
    # the seed scheme: sample k of prompt p is seeded prompt_seeds(seed)[p] + k, whatever else shares the batch
    both = generate(engine, prompts[:2], G, SamplingParams(max_new_tokens=6, seed=3))
    seed = prompt_seeds(3, 2)[1]
    alone = generate(engine, prompts[1:2], G, SamplingParams(max_new_tokens=6), seeds=[seed])
    shifted = engine.generate_segments([SegmentRequest(prompts[1], seed + 1, 6)], SamplingParams())[0]
    n = alone.response_lengths
    assert torch.equal(both.response_ids[2:, : int(n.max())], alone.response_ids)
    torch.testing.assert_close(both.sampling_logprobs[2:, : int(n.max())], alone.sampling_logprobs, rtol=0, atol=1e-5)
    assert shifted.tokens == alone.response_ids[1, : len(shifted.tokens)].tolist()
    assert not torch.equal(both.response_ids[0], both.response_ids[1])  # seeds s and s + 1 differ
    with pytest.raises(ValueError, match="2 prompt seeds for 3 prompts"):
        generate(engine, prompts, 1, SamplingParams(), seeds=[1, 2])


def test_requests_have_their_own_limits_and_a_context_is_prefilled_once(engine, prompts):
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        long, short, other = engine.generate_segments(
            [SegmentRequest(prompts[0], 5, 9), SegmentRequest(prompts[0], 6, 2), SegmentRequest(prompts[1], 7, 4)],
            SamplingParams(stop_token_ids=()))
    finally:
        hook.remove()
    assert calls[0][0] == 2  # the prefill: two distinct contexts for three requests
    assert len(short.tokens) <= 2 and (short.finish == "length") == (len(short.tokens) == 2)
    alone = engine.generate_segments([SegmentRequest(prompts[0], 5, 9)], SamplingParams())[0]
    assert long.tokens == alone.tokens and long.finish == alone.finish and len(other.tokens) <= 4
    assert long.version is None and long.text == engine.tokenizer.decode(long.tokens, skip_special_tokens=True)


def test_stop_strings_end_a_row_at_the_token_that_completes_them(engine, prompts):
    free = generate(engine, prompts[:1], 1, SamplingParams(max_new_tokens=12, temperature=0.0))
    ids = free.response_ids[0][free.response_mask[0]].tolist()
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    cut = next(k for k in range(3, len(ids)) if len(engine.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= 3)
    target = engine.tokenizer.decode(ids[:cut], skip_special_tokens=True)[-3:]  # 3 characters ending in token cut-1
    first = text.find(target)  # where the string first appears decides the stop
    stopped = generate(engine, prompts[:1], 1, SamplingParams(max_new_tokens=12, temperature=0.0, stop=(target,)))
    kept = stopped.response_ids[0][stopped.response_mask[0]].tolist()
    assert stopped.finish_reason == ["stop"] and kept == ids[: len(kept)]
    assert target in engine.tokenizer.decode(kept, skip_special_tokens=True)  # the completing token is kept
    assert target not in engine.tokenizer.decode(kept[:-1], skip_special_tokens=True)
    assert len(engine.tokenizer.decode(kept, skip_special_tokens=True)) >= first + len(target)
