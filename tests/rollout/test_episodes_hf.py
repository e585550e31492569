"""Tool-integrated episodes on the real HF engine (the tiny TIR model of tests/conftest.py, calling the
real calculator): the same seed gives the same episodes, and the sampler's log-probs of the policy's
tokens are those of one teacher-forced forward over the whole episode, context tokens as inputs."""

from __future__ import annotations

import pytest
import torch

from stapo.rollout import HFEngine, SamplingParams, ToolEpisodes, generate
from stapo.tools import build_tool, build_tool_parser


@pytest.fixture(scope="module")
def episodes(tir_model_dir):
    from stapo.tiny.task import CHAT_INSTRUCTION
    from stapo.tiny.tir import tir_problems, tir_tool_schemas

    engine = HFEngine(tir_model_dir)
    tok = engine.tokenizer
    tools = ToolEpisodes(tok, build_tool_parser("qwen3", tools=("calculator",)),
                         {"calculator": build_tool("calculator")}, max_turns=3)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{p.question} {CHAT_INSTRUCTION}"}],
                                     tools=tir_tool_schemas(), tokenize=False, add_generation_prompt=True)
             for p in tir_problems(4, seed=7, easy_fraction=0.5)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return lambda n, seed: generate(engine, prompts, n, SamplingParams(seed=seed, max_new_tokens=64), tools=tools), engine


def test_the_same_seed_gives_the_same_episodes(episodes):
    run, _ = episodes
    a = run(2, 3)
    b = run(2, 3)
    assert a.context_mask.any(), "no episode called a tool"
    assert bool((a.episodes.tool_calls > 0).any()) and bool((a.episodes.turns >= 2).any())
    for name in ("response_ids", "response_mask", "context_mask", "sampling_logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.response_text == b.response_text and a.finish_reason == b.finish_reason
    assert torch.equal(a.episodes.tool_calls, b.episodes.tool_calls)
    c = run(2, 4)
    assert c.response_text != a.response_text


def test_sampler_logprobs_match_a_teacher_forced_pass_over_the_episode(episodes):
    from stapo.distributed.policy import response_token_stats, teacher_forced_inputs

    run, engine = episodes
    r = run(2, 5)
    assert r.context_mask.any()
    inputs = teacher_forced_inputs(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, packed=True,
                                   context_mask=r.context_mask)
    with torch.no_grad():
        logprobs, _ = response_token_stats(engine.model, inputs, temperature=1.0, chunk_size=64)
    t = logprobs.shape[1]
    sampled = r.sampling_logprobs[:, :t][r.response_mask[:, :t]]
    torch.testing.assert_close(logprobs[r.response_mask[:, :t]], sampled, rtol=0, atol=2e-5)
    assert (logprobs[r.context_mask[:, :t]] == 0).all()
