"""Tool episodes (stapo/rollout/episodes.py on the driver, stapo/rollout/drivers.py): turns, context tokens,
budgets, seeds, tool sessions, and a turn cut by a sync.

A scripted engine stands in for the policy here so that every branch is exact (which turn calls which
tool, where a budget cuts): it answers each context with the text its script gives, through the real
TIR tokenizer and chat template, and records what the driver asked for. The real engines run episodes in
tests/rollout/test_episodes_hf.py and the vLLM lane.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest

from stapo.rollout import RolloutEngine, SamplingParams, Segment, ToolEpisodes, generate
from stapo.rollout.tool_turns import ToolTurnRenderer
from stapo.rollout.trajectory import prompt_seeds, segment_seed
from stapo.tools import Tool, ToolError, build_tool, build_tool_parser, register_tool

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


@register_tool("test_counter")
@dataclass
class Counter(Tool):
    """Counts the calls of its episode's session (a stateful tool for these tests)."""

    parameters = {"type": "object", "properties": {}}
    opened = []  # every session opened, across episodes

    def open_session(self):
        session = _Session()
        Counter.opened.append(session)
        return session

    def run(self, arguments, session):
        if session is None:
            raise ToolError("no session")
        session.calls += 1
        return str(session.calls)


class _Session:
    def __init__(self):
        self.calls, self.closed = 0, False

    def close(self):
        self.closed = True


class ScriptedEngine(RolloutEngine):
    """Answers a context with ``script(context_text)`` (tokenized, cut at the request's limit), sampler
    logprob -0.25 each; records every call's requests."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []
        self.pad_token_id = tokenizer.pad_token_id

    def generate_segments(self, requests, sampling):
        self.calls.append((list(requests), sampling))
        out = []
        for r in requests:
            ids = self.tokenizer(self.script(self.tokenizer.decode(r.context, skip_special_tokens=False)),
                                 add_special_tokens=False)["input_ids"]
            finish = "length" if len(ids) > r.max_new_tokens else "stop"
            ids = ids[: r.max_new_tokens]
            out.append(Segment(ids, [-0.25] * len(ids), self.tokenizer.decode(ids, skip_special_tokens=True), finish))
        return out

    def weight_update(self, version=None):
        return contextlib.nullcontext()

    def load_weights(self, weights):
        pass


def episodes(engine, prompts, n, parser, tools, *, max_turns, max_tokens, seed=0):
    """``n`` episodes of each prompt with a budget of ``max_tokens`` policy + context tokens."""
    return generate(engine, prompts, n, SamplingParams(seed=seed, max_new_tokens=max_tokens),
                    tools=ToolEpisodes(engine.tokenizer, parser, tools, max_turns=max_turns))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from stapo.tiny.tir import build_tir_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tir_tokenizer()))


def _prompt(tokenizer, question: str) -> list[int]:
    from stapo.tiny.tir import tir_tool_schemas

    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tir_tool_schemas(),
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_call_then_an_answer_is_one_row_with_context_tokens(tokenizer):
    # turn 1 calls the calculator; the loop appends the tool turn as context; turn 2 answers
    def script(context):
        return "\\boxed{42}<|im_end|>" if "<tool_response>" in context else CALL % "6*7"

    inner = ScriptedEngine(tokenizer, script)
    parser = build_tool_parser("qwen3", tools=("calculator",))
    prompt = _prompt(tokenizer, "Compute 6*7.")
    r = episodes(inner, [prompt], 2, parser, {"calculator": build_tool("calculator")}, max_turns=3, max_tokens=80,
                 seed=5)
    call_ids = tokenizer(CALL % "6*7", add_special_tokens=False)["input_ids"]
    context = ToolTurnRenderer(tokenizer, parser).text(["42"])
    assert context == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer("\\boxed{42}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert r.response_ids[0].tolist()[: len(call_ids) + len(context_ids) + len(answer_ids)] == \
        call_ids + context_ids + answer_ids
    c, k, a = len(call_ids), len(context_ids), len(answer_ids)
    assert r.response_mask[0].tolist() == [True] * c + [False] * k + [True] * a
    assert r.context_mask[0].tolist() == [False] * c + [True] * k + [False] * a
    assert (r.sampling_logprobs[r.context_mask] == 0).all() and (r.sampling_logprobs[r.response_mask] == -0.25).all()
    assert r.finish_reason == ["stop", "stop"] and r.answer_text == ["\\boxed{42}", "\\boxed{42}"]
    assert r.response_text[0] == CALL % "6*7" + context + "\\boxed{42}"
    assert r.episodes.turns.tolist() == [2, 2] and r.episodes.tool_calls.tolist() == [1, 1]
    assert r.episodes.tool_errors.tolist() == [0, 0] and r.group_index.tolist() == [0, 0]
    assert r.prompt_ids[0, -len(prompt):].tolist() == prompt
    # turn 2's prompt is everything so far; one call per turn over the live episodes, one request each
    (first, s1), (second, s2) = inner.calls
    assert [q.context for q in first] == [prompt, prompt] and second[0].context == prompt + call_ids + context_ids
    # each episode's requests carry its own seeds: sample k's, then its segment 1's (stapo.rollout.trajectory)
    sample = prompt_seeds(5, 1)[0]
    assert [q.seed for q in first] == [sample, sample + 1]
    assert [q.seed for q in second] == [segment_seed(sample, 1), segment_seed(sample + 1, 1)]
    assert "</tool_call>" in s1.stop and tokenizer.convert_tokens_to_ids("</tool_call>") in s1.stop_token_ids
    # each turn may use what is left of the episode's budget (80 tokens): turn 2 after the first turn's
    assert [q.max_new_tokens for q in first] == [80, 80] and [q.max_new_tokens for q in second] == [80 - c - k] * 2


def test_budget_and_turn_limits_end_episodes_with_length(tokenizer):
    parser = build_tool_parser("qwen3", tools=("calculator",))
    always_call = ScriptedEngine(tokenizer, lambda context: CALL % "1+1")
    calc = {"calculator": build_tool("calculator")}
    prompt = _prompt(tokenizer, "Compute 1+1.")
    call_len = len(tokenizer(CALL % "1+1", add_special_tokens=False)["input_ids"])
    # out of turns with a call pending: the last turn's call is counted, not run, and nothing is appended
    r = episodes(always_call, [prompt], 1, parser, calc, max_turns=2, max_tokens=200)
    assert r.finish_reason == ["length"] and r.episodes.turns.tolist() == [2] and r.episodes.tool_calls.tolist() == [2]
    assert int(r.response_mask.sum()) == 2 * call_len and not r.context_mask[0, -1]  # ends on a policy token
    # a budget that cuts inside the first turn: the kept tokens are a prefix of the sample
    r = episodes(always_call, [prompt], 1, parser, calc, max_turns=3, max_tokens=5)
    assert r.finish_reason == ["length"] and int(r.response_mask.sum()) == 5 and r.episodes.tool_calls.tolist() == [0]
    # room for the call but not for its tool turn plus one more token: ends before the context
    r = episodes(always_call, [prompt], 1, parser, calc, max_turns=3, max_tokens=call_len + 3)
    assert r.finish_reason == ["length"] and not r.context_mask.any() and r.episodes.tool_calls.tolist() == [1]


def test_malformed_calls_and_unknown_tools_get_error_results(tokenizer):
    def script(context):
        if "<tool_response>" not in context:
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+"}}\n</tool_call>'
        if context.count("<tool_response>") == 1:
            return "<tool_call>\n{not json}\n</tool_call>"
        return "\\boxed{0}<|im_end|>"

    r = episodes(ScriptedEngine(tokenizer, script), [_prompt(tokenizer, "Compute 1+1.")], 1, build_tool_parser("qwen3"),
                 {"calculator": build_tool("calculator")}, max_turns=4, max_tokens=400)
    assert r.episodes.tool_calls.tolist() == [2] and r.episodes.tool_errors.tolist() == [2]
    assert r.finish_reason == ["stop"] and "not an arithmetic expression" in r.response_text[0]
    assert "tool call is not valid JSON" in r.response_text[0]
    web = ScriptedEngine(tokenizer, lambda c: "\\boxed{1}<|im_end|>" if "<tool_response>" in c else
                         '<tool_call>\n{"name": "web", "arguments": {}}\n</tool_call>')
    unknown = episodes(web, [_prompt(tokenizer, "?")], 1, build_tool_parser("qwen3"),
                       {"calculator": build_tool("calculator")}, max_turns=2, max_tokens=200)
    assert "unknown tool 'web'" in unknown.response_text[0] and unknown.episodes.tool_errors.tolist() == [1]


def test_a_stateful_tool_keeps_one_session_per_episode(tokenizer):
    call = '<tool_call>\n{"name": "test_counter", "arguments": {}}\n</tool_call>'
    Counter.opened.clear()
    counting = ScriptedEngine(tokenizer, lambda c: call + call if c.count("<tool_response>") < 3 else "x")
    r = episodes(counting, [_prompt(tokenizer, "Count.")], 2, build_tool_parser("qwen3"), {"test_counter": Counter()},
                 max_turns=3, max_tokens=400)
    # turn 1: calls 1 and 2 of the episode's session; turn 2: 3 and 4 (state kept across turns)
    assert all("<tool_response>\n4\n</tool_response>" in text for text in r.response_text)
    assert len(Counter.opened) == 2 and all(s.closed and s.calls == 4 for s in Counter.opened)
    assert r.episodes.tool_calls.tolist() == [4, 4]


def test_the_renderer_needs_a_template_with_tool_turns(tokenizer, tiny_tokenizer):
    parser = build_tool_parser("qwen3")
    renderer = ToolTurnRenderer(tokenizer, parser)
    two = renderer.text(["1", "2"])
    assert two == "<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n" \
                  "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert renderer.text(["1"], after_eos="<|im_end|>").startswith("\n<|im_start|>user")  # the turn ended with EOS
    inline = ToolTurnRenderer(tokenizer, build_tool_parser("python_block"))
    assert inline.text(["4"]) == "\n4\n```\n"
    tiny_tokenizer = type(tiny_tokenizer).from_pretrained(tiny_tokenizer.name_or_path)
    tiny_tokenizer.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ValueError, match="cannot render tool results"):
        ToolTurnRenderer(tiny_tokenizer, parser)
