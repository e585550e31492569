"""Tool-integrated episodes on the REAL vLLM engines (docs/tir.md): colocated, twice from one seed, and
on the lane's rollout servers (``rollout.mode: server``).

The lane's warm arithmetic model writes worked steps (``7+5=12. 12-3=9. ...``). An inline calculator
format turns each step into a tool call: the turn stops at ``=`` (vLLM's ``stop``), the real calculator
evaluates the expression before it, and its result is appended as context tokens, from which the policy
writes the next step. Every episode of the warm model is thus several turns with tool calls.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _bounds import assert_fp32_noise, assert_like_colocated, report
from conftest import LANE_TOKEN

from stapo.rollout import SamplingParams, ToolEpisodes, VLLMEngine, generate
from stapo.tools import ParsedTurn, ToolCall, ToolCallParser, build_tool, register_tool_parser

pytestmark = pytest.mark.timeout(1200)


@register_tool_parser("lane_equals")
class EqualsParser(ToolCallParser):
    """``12-3=``: a call of the calculator on the expression before ``=``, its result written inline."""

    stop = ("=",)

    def parse(self, text: str) -> ParsedTurn:
        if not text.endswith("="):
            return ParsedTurn([])
        expression = text[:-1].split()[-1] if text[:-1].split() else ""
        return ParsedTurn([ToolCall("calculator", {"expression": expression}, text)])

    def render_results(self, texts: list[str]) -> str:
        return texts[0]


def lane_tools(tokenizer) -> ToolEpisodes:
    return ToolEpisodes(tokenizer, EqualsParser(), {"calculator": build_tool("calculator")}, max_turns=4)


class Episodes:
    """``generate(prompts, n, sampling)``: the lane's tool episodes (48 tokens each) on ``engine``."""

    def __init__(self, engine, tokenizer) -> None:
        self.engine, self.tokenizer, self.pad_token_id = engine, tokenizer, engine.pad_token_id
        self.tools = lane_tools(tokenizer)

    def generate(self, prompts, n, sampling):
        return generate(self.engine, prompts, n, replace(sampling, max_new_tokens=48), tools=self.tools)


@pytest.fixture(scope="module")
def chains(warm_model_dir) -> list[list[int]]:
    """Four 5-term problems (the warm model's task): most of its answers are worked steps, i.e. calls."""
    from transformers import AutoTokenizer

    from stapo.tiny import CHAT_INSTRUCTION, arithmetic_problems

    tok = AutoTokenizer.from_pretrained(str(warm_model_dir))
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{p.question} {CHAT_INSTRUCTION}"}],
                                     tokenize=False, add_generation_prompt=True)
             for p in arithmetic_problems(4, seed=21, terms=5)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def colocated(warm_model_dir):
    from transformers import AutoTokenizer

    inner = VLLMEngine(warm_model_dir, dtype="float32", max_model_len=512, enforce_eager=True)
    yield Episodes(inner, AutoTokenizer.from_pretrained(str(warm_model_dir)))
    inner.close()


SAMPLING = SamplingParams(temperature=1.0, seed=11)


def trainer_mismatch(model, r) -> float:
    """Max |vLLM - trainer| log-prob of the policy's tokens, the trainer's teacher-forced pass over the whole
    episode (its tool results as context)."""
    from stapo.distributed.policy import response_token_stats, teacher_forced_inputs

    inputs = teacher_forced_inputs(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, packed=True,
                                   context_mask=r.context_mask)
    with torch.no_grad():
        logprobs, _ = response_token_stats(model, inputs, temperature=1.0, chunk_size=64)
    mask = r.response_mask[:, :logprobs.shape[1]]
    return float((logprobs[mask] - r.sampling_logprobs[:, :logprobs.shape[1]][mask]).abs().max())


def test_the_same_seed_gives_the_same_episodes_on_the_colocated_engine(colocated, chains, warm_model_dir):
    from transformers import AutoModelForCausalLM

    a = colocated.generate(chains, 4, SAMPLING)
    b = colocated.generate(chains, 4, SAMPLING)
    assert int((a.episodes.turns >= 3).sum()) >= 4, a.response_text  # episodes with several calls
    assert a.context_mask.any()
    for name in ("response_ids", "response_mask", "context_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.sampling_logprobs - b.sampling_logprobs).abs().max() == 0
    assert a.response_text == b.response_text
    # each context segment is the calculator's answer (its value, or its error) to the expression before it
    tok, calculator = colocated.tokenizer, build_tool("calculator")
    checked = 0
    for ids, policy, context in zip(a.response_ids.tolist(), a.response_mask.tolist(), a.context_mask.tolist()):
        for t in range(1, len(ids)):
            if context[t] and not context[t - 1]:
                end = next((u for u in range(t, len(ids)) if not context[u]), len(ids))
                written = tok.decode([i for i, p in zip(ids[:t], policy[:t]) if p])
                expression = written[:-1].split()[-1]
                assert tok.decode(ids[t:end]) == calculator({"expression": expression}).text, written
                checked += 1
    assert checked >= 8
    # vLLM's log-probs of the policy's tokens are the trainer's teacher-forced ones over the whole episode
    hf = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32).eval()
    colocated = trainer_mismatch(hf, a)
    report("tool episodes, colocated engine vs the trainer", colocated)
    assert_fp32_noise(colocated, "tool episodes, colocated engine")


def test_server_mode_runs_the_same_episodes(servers, colocated, chains, warm_model_dir):
    from transformers import AutoModelForCausalLM

    from stapo.servers.engine import ServerEngine
    from stapo.sync.buckets import sync_weights

    remote = ServerEngine([s.address for s in servers], pad_token_id=colocated.pad_token_id, token=LANE_TOKEN)
    warm = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    sync_weights(warm, remote, bucket_bytes=2**20, version=0)  # other tests of the session may have trained them
    episodes = Episodes(remote, colocated.tokenizer)
    got = episodes.generate(chains, 4, SAMPLING)
    again = episodes.generate(chains, 4, SAMPLING)
    local = colocated.generate(chains, 4, SAMPLING)
    assert got.context_mask.any() and int((got.episodes.turns >= 3).sum()) >= 4
    assert got.response_text == again.response_text == local.response_text
    assert torch.equal(got.response_ids, local.response_ids) and torch.equal(got.context_mask, local.context_mask)
    # the same episodes: against the trainer's recompute, the server path's log-probs are the colocated engine's
    colocated = trainer_mismatch(warm, local)
    report("tool episodes, server vs colocated engine: max |server - colocated| log-prob",
           float((got.sampling_logprobs - local.sampling_logprobs).abs().max()))
    assert_fp32_noise(colocated, "tool episodes, colocated engine")
    assert_like_colocated(trainer_mismatch(warm, got), colocated, "tool episodes, server")
