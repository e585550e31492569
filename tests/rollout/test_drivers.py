"""The drivers compose (stapo/rollout/drivers.py): a tool episode cut by a sync anywhere — in a turn, between
a turn and its tool turn, inside a multi-token stop string — continues to the episode an uncut run gives; the
segments after a cut have their own seeds and carry their version; one-turn samples follow the seed scheme.

The policy here is deterministic and seed-blind (each turn writes a fixed text; a continuation writes what is
left of it), so an episode cut anywhere must come out token for token as the uncut one. The real engines:
tests/rollout/test_partial.py (servers), tests/vllm_cpu/test_vllm_partial.py (a real server, exact continuations).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from stapo.rollout import Generation, RolloutEngine, SamplingParams, Segment, ToolEpisodes, generate
from stapo.rollout.trajectory import prompt_seeds, segment_seed
from stapo.tools import build_tool, build_tool_parser

QWEN3 = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
         "The product is \\boxed{42}<|im_end|>"]
BLOCK = ["Let me compute it.\n```python\nprint(6*7)\n```output\nnever seen",  # stops at ```output
         "So \\boxed{42}<|im_end|>"]


class TurnPolicy(RolloutEngine):
    """Writes ``turns[k]`` in the turn after the k-th tool turn (the ``marker`` counts them), continuing a cut
    turn from its written prefix; stops like vLLM (a stop id, or a stop string in the NEW text) or at the
    request's limit; ``cuts[c] = m``: call c is interrupted after m new tokens."""

    interruptible = True

    def __init__(self, tokenizer, turns: list[str], marker: str, cuts: dict[int, int] | None = None) -> None:
        self.tokenizer, self.marker, self.cuts, self.calls = tokenizer, marker, dict(cuts or {}), []
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        self.pad_token_id, self.policy_version = tokenizer.pad_token_id, 1

    def generate_segments(self, requests, sampling):
        cut = self.cuts.get(len(self.calls))
        self.calls.append(list(requests))
        return [self._answer(r, sampling, cut) for r in requests]

    def _answer(self, request, sampling, cut):
        text = self.tokenizer.decode(request.context, skip_special_tokens=False)
        target = self.turns[min(text.count(self.marker), len(self.turns) - 1)]
        context = request.context
        written = next(k for k in range(len(target), -1, -1) if context[len(context) - k:] == target[:k])
        new, finish = [], "stop"
        for token in target[written:]:
            if cut is not None and len(new) == cut:
                finish = "interrupted"
                break
            if len(new) == request.max_new_tokens:
                finish = "length"
                break
            new.append(token)
            if token in sampling.stop_token_ids or any(
                    s in self.tokenizer.decode(new, skip_special_tokens=True) for s in sampling.stop):
                break
        return Segment(new, [-0.5] * len(new), self.tokenizer.decode(new, skip_special_tokens=True), finish,
                       self.policy_version)

    def weight_update(self, version=None):
        return contextlib.nullcontext()

    def load_weights(self, weights):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from stapo.tiny.tir import build_tir_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tir_tokenizer()))


def _prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _run(policy: TurnPolicy, prompts, parser) -> tuple[Generation, list[bool]]:
    """Advance a 2-sample generation to the end; a cut is a sync: the version moves on."""
    tools = ToolEpisodes(policy.tokenizer, parser, {"calculator": build_tool("calculator"),
                                                    "python": build_tool("calculator")}, max_turns=3)
    batch = Generation(prompts, 2, SamplingParams(seed=7, max_new_tokens=120), tools=tools)
    rounds = []
    while not rounds or not rounds[-1]:
        rounds.append(batch.advance(policy))
        policy.policy_version += not rounds[-1]
    return batch, rounds


@pytest.mark.parametrize("cuts", [{0: 3}, {0: 9, 1: 2}, {1: 1}, {1: 4, 2: 2}, {0: 1, 2: 1, 3: 1}])
def test_a_tool_episode_cut_by_syncs_is_the_uncut_episode(tokenizer, cuts):
    prompts = [_prompt(tokenizer, "Compute 6*7."), _prompt(tokenizer, "What is 6 times 7?")]
    parser = build_tool_parser("qwen3", tools=("calculator",))
    whole, _ = _run(TurnPolicy(tokenizer, QWEN3, "<tool_response>"), prompts, parser)
    policy = TurnPolicy(tokenizer, QWEN3, "<tool_response>", cuts)
    cut, rounds = _run(policy, prompts, parser)
    a, b = whole.rollout(policy.pad_token_id), cut.rollout(policy.pad_token_id)
    for name in ("response_ids", "response_mask", "context_mask", "sampling_logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.response_text == b.response_text and a.finish_reason == b.finish_reason == ["stop"] * 4
    assert a.answer_text == b.answer_text == ["The product is \\boxed{42}"] * 4
    assert a.episodes.turns.tolist() == b.episodes.turns.tolist() == [2] * 4  # a cut turn is still one turn
    assert b.episodes.tool_calls.tolist() == [1] * 4 and rounds.count(False) == len(cuts)
    assert cut.interrupted == 4 * len(cuts)  # every sample was under way at each cut
    # every token carries the version that sampled it: each cut (a sync) moved it on
    versions = b.token_version[b.response_mask]
    assert versions.min() == 1 and versions.max() == 1 + len(cuts) and b.token_version[b.context_mask].eq(0).all()
    # each request of a sample after a cut is its next segment, with that segment's seed
    sample = prompt_seeds(7, 2)[1] + 1  # prompt 1, sample 1: row 3
    seeds = [call[3].seed for call in policy.calls if len(call) == 4]
    assert seeds == [segment_seed(sample, j) for j in range(len(seeds))]


def test_a_stop_string_split_by_the_cut_ends_the_turn_where_an_uncut_one_does(tokenizer):
    prompts = [_prompt(tokenizer, "Compute 6*7.")]
    parser = build_tool_parser("python_block")
    whole, _ = _run(TurnPolicy(tokenizer, BLOCK, "```\n"), prompts, parser)
    first = tokenizer(BLOCK[0], add_special_tokens=False)["input_ids"]
    inside = next(m for m in range(1, len(first)) if tokenizer.decode(first[:m]).endswith("```out"))
    cut, rounds = _run(TurnPolicy(tokenizer, BLOCK, "```\n", {0: inside}), prompts, parser)
    assert rounds == [False, True]
    a, b = whole.rollout(0), cut.rollout(0)
    assert a.response_text == b.response_text and torch.equal(a.response_ids, b.response_ids)
    assert "never seen" not in b.response_text[0] and b.episodes.tool_calls.tolist() == [1, 1]
    assert b.answer_text == ["So \\boxed{42}"] * 2


def test_one_turn_samples_follow_the_seed_scheme(tokenizer):
    policy = TurnPolicy(tokenizer, ["\\boxed{1}<|im_end|>"], "never")
    r = generate(policy, [[5, 6], [7]], 3, SamplingParams(seed=11, max_new_tokens=4))
    (requests,) = policy.calls
    seeds = prompt_seeds(11, 2)
    assert [q.seed for q in requests] == [seeds[p] + k for p in range(2) for k in range(3)]
    assert [q.max_new_tokens for q in requests] == [4] * 6 and r.finish_reason == ["length"] * 6
    assert r.episodes is None and not r.context_mask.any() and r.policy_version.tolist() == [1] * 6
    with pytest.raises(ValueError, match="n \\(samples per prompt\\) must be >= 1"):
        generate(policy, [[5]], 0, SamplingParams())
    policy.cuts = {1: 1}
    with pytest.raises(RuntimeError, match="interrupted"):
        generate(policy, [[5]], 1, SamplingParams(seed=0))


def test_a_sample_cut_at_its_last_token_ends_with_length(tokenizer):
    policy = TurnPolicy(tokenizer, ["\\boxed{12345}<|im_end|>"], "never", cuts={0: 3})
    batch = Generation([[5, 6]], 1, SamplingParams(seed=1, max_new_tokens=3))
    assert batch.advance(policy) is False  # cut after 3 tokens: the budget is spent
    assert batch.advance(policy) is True and len(policy.calls) == 1  # nothing left to ask for
    assert batch.rollout(0).finish_reason == ["length"] and batch.rollout(0).response_lengths.tolist() == [3]
