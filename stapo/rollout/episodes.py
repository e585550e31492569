"""Multi-turn, tool-integrated episodes on any rollout engine (docs/tir.md).

`EpisodeEngine` wraps a `RolloutEngine` and is one itself: ``generate(prompts, n, sampling)`` runs
P·n episodes and returns ONE `Rollout` row per episode, so groups, rewards, advantages, the trainer
and the inspector work unchanged. Per turn:

1. ONE ``generate`` call over the live episodes' whole token contexts (prompt + everything so far),
   n = 1 each, stopping at the parser's stop strings (a closed tool call) or EOS; vLLM's prefix cache
   keeps the continuation cheap. Each request has its own seed, derived per (episode, turn) from
   ``sampling.seed`` (`episode_seed`), so a seed reproduces an episode whatever else is in the batch.
2. Parse the turn (``rollout.tools.parser``). No call: the episode is done, and its turn is the final
   answer the verifier scores. A malformed call is answered with the parser's error message.
3. Run every live episode's calls together (`stapo.tools.run_tool_calls`; a stateful tool keeps one
   session per episode), render the results as the template's tool turn (`ToolTurnRenderer`) and append
   them as CONTEXT tokens: read by the model, never sampled, silenced, counted or given gradient.
4. Stop at a final answer, ``max_turns`` policy turns, or the episode's token budget
   (``max_tokens`` policy + context tokens: ``rollout.max_response_length``). An episode cut by the
   budget or the turn limit finishes with reason ``length``.

Tokens past an episode's budget are dropped after sampling (one ``max_new_tokens`` serves the whole
call); a truncated autoregressive sample is a sample of the shorter length, so nothing is biased.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from stapo.rollout.batch import EpisodeInfo, Rollout, left_pad, right_pad
from stapo.rollout.engine import check_prompts
from stapo.rollout.sampling import SamplingParams, derived_seed
from stapo.rollout.tool_turns import ToolTurnRenderer
from stapo.tools import Tool, ToolCallParser, ToolResult, run_tool_calls

__all__ = ["EpisodeEngine", "episode_seed"]


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The request seed of ``turn`` of ``episode`` in a call seeded with ``seed`` (independent streams)."""
    return derived_seed(derived_seed(seed, episode), turn)


@dataclass
class _Episode:
    """One episode while it runs: its token context and the response segments so far."""

    context: list[int]  # prompt + response so far: the next turn's prompt
    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)  # True: sampled by the policy, False: context token
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    final_text: str = ""
    finish: str = ""  # "" while live, then "stop" or "length"
    turns: int = 0
    calls: int = 0
    errors: int = 0
    tool_seconds: float = 0.0
    sessions: dict = field(default_factory=dict)  # tool name -> its session for this episode

    def append(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        self.ids += ids
        self.context += ids
        self.policy += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.texts.append(text)

    def close(self, finish: str) -> None:
        self.finish = finish
        for session in self.sessions.values():
            if session is not None:
                session.close()
        self.sessions = {}


class EpisodeEngine:
    """A `RolloutEngine` whose rows are multi-turn tool-calling episodes (see the module docstring).

    Args:
        engine: the engine that samples each turn (HF, colocated vLLM, rollout servers, ...); weight
            syncs, ``sleep`` / ``wake`` and any other attribute go to it.
        tokenizer: the policy's tokenizer (decodes turns, renders tool turns).
        parser: the call format (`stapo.tools.build_tool_parser`).
        tools: the callable tools by name (`stapo.tools.build_tool`).
        max_turns: policy turns per episode at most.
        max_tokens: policy + context tokens per episode at most.
        max_workers: tool calls that run at once.
        template_kwargs: chat-template arguments of the prompts (e.g. ``enable_thinking``).
    """

    def __init__(self, engine, tokenizer, parser: ToolCallParser, tools: Mapping[str, Tool], *, max_turns: int,
                 max_tokens: int, max_workers: int = 8, template_kwargs: dict | None = None) -> None:
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"EpisodeEngine needs max_turns >= 1 and max_tokens >= 1, got {max_turns}, {max_tokens}")
        self.engine, self.tokenizer, self.parser, self.tools = engine, tokenizer, parser, dict(tools)
        self.max_turns, self.max_tokens, self.max_workers = max_turns, max_tokens, max_workers
        self.renderer = ToolTurnRenderer(tokenizer, parser, template_kwargs)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        added = tokenizer.get_added_vocab()  # a stop tag that is one added token also stops by id
        self.stop_ids = tuple(added[s] for s in parser.stop if s in added)

    # ---- the RolloutEngine protocol: weights and memory are the wrapped engine's ----
    def weight_update(self, *args, **kwargs):  # rollout servers take the policy version
        return self.engine.weight_update(*args, **kwargs)

    def load_weights(self, weights) -> None:
        self.engine.load_weights(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def __getattr__(self, name: str):  # pad_token_id, needs_weights, policy_version, ...: the engine's
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # ---- episodes ----
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """``n`` episodes per prompt; row b answers prompt b // n (see `Rollout`, `EpisodeInfo`)."""
        prompts = check_prompts(prompt_ids, n)
        episodes = [_Episode(context=list(p)) for p in prompts for _ in range(n)]
        waited = 0.0
        try:
            for turn in range(self.max_turns):
                live = [b for b, e in enumerate(episodes) if not e.finish]
                if not live:
                    break
                calls = self._policy_turn(episodes, live, turn, sampling)
                for b, parsed in calls.items():
                    episodes[b].calls += max(len(parsed.calls), 1)  # a malformed call counts as one failed call
                if calls and turn < self.max_turns - 1:  # on the last turn no turn is left to read results
                    start = time.perf_counter()
                    self._tool_turn(episodes, calls)
                    waited += time.perf_counter() - start
        finally:
            for e in episodes:
                if not e.finish:
                    e.close("length")  # out of turns with a call pending
        return self._rollout(prompts, n, episodes, waited)

    def _policy_turn(self, episodes: list[_Episode], live: list[int], turn: int,
                     sampling: SamplingParams) -> dict[int, object]:
        """One ``generate`` over the live episodes; returns the parsed turns that hold calls (or errors)."""
        room = {b: self.max_tokens - len(episodes[b].ids) for b in live}
        seeds = None if sampling.seed is None else tuple(episode_seed(sampling.seed, b, turn) for b in live)
        params = replace(sampling, max_new_tokens=max(room.values()), request_seeds=seeds, seed=None,
                         stop=tuple(dict.fromkeys((*sampling.stop, *self.parser.stop))),
                         stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *self.stop_ids))))
        out = self.engine.generate([episodes[b].context for b in live], 1, params)
        pending = {}
        for row, b in enumerate(live):
            e, sampled = episodes[b], out.response_mask[row]
            ids = out.response_ids[row][sampled].tolist()
            cut = len(ids) > room[b] or out.finish_reason[row] == "length"  # the budget ran out in this turn
            ids = ids[: room[b]]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.append(ids, out.sampling_logprobs[row][sampled].tolist()[: len(ids)], text)
            e.turns += 1
            e.final_text = text
            if cut:
                e.close("length")
                continue
            parsed = self.parser.parse(text)
            if parsed.final:
                e.close("stop")
            else:
                pending[b] = parsed
        return pending

    def _tool_turn(self, episodes: list[_Episode], parsed: dict) -> None:
        """Run the calls of every episode that made some, then append each one's tool turn as context."""
        results = self._run_calls(episodes, parsed)
        for b in parsed:
            e = episodes[b]
            e.errors += sum(r.error for r in results[b])
            e.tool_seconds += sum(r.seconds for r in results[b])
            last = e.ids[-1] if e.ids else None
            after_eos = self.tokenizer.decode([last]) if last in self.eos_ids else ""
            text = self.renderer.text([r.text for r in results[b]], after_eos)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(e.ids) + len(ids) + 1 > self.max_tokens:  # no room left for a policy token after it
                e.close("length")
                continue
            e.append(ids, None, text)

    def _run_calls(self, episodes: list[_Episode], parsed: dict) -> dict[int, list[ToolResult]]:
        """Each episode's results in call order: all calls run together, one session per (episode, tool);
        a malformed turn or an unknown tool gets its error message as the result."""
        jobs, slots = [], []
        results: dict[int, list] = {}
        for b, turn in parsed.items():
            if turn.error is not None:
                results[b] = [ToolResult(turn.error, True, 0.0)]
                continue
            results[b] = [None] * len(turn.calls)
            for k, call in enumerate(turn.calls):
                tool = self.tools.get(call.name)
                if tool is None:
                    results[b][k] = ToolResult(f"unknown tool {call.name!r}; available tools: "
                                               f"{', '.join(sorted(self.tools))}", True, 0.0)
                    continue
                sessions = episodes[b].sessions
                if call.name not in sessions:
                    sessions[call.name] = tool.open_session()
                jobs.append((tool, call, sessions[call.name]))
                slots.append((b, k))
        for (b, k), result in zip(slots, run_tool_calls(jobs, self.max_workers) if jobs else []):
            results[b][k] = result
        return results

    def _rollout(self, prompts: list[list[int]], n: int, episodes: list[_Episode], waited: float) -> Rollout:
        pad = self.engine.pad_token_id
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad)
        response_ids = right_pad([e.ids for e in episodes], pad, torch.long)  # (B, T)
        policy = right_pad([[int(x) for x in e.policy] for e in episodes], 0, torch.long)  # (B, T)
        real = right_pad([[1] * len(e.ids) for e in episodes], 0, torch.long).bool()  # (B, T)
        info = EpisodeInfo(
            turns=torch.tensor([e.turns for e in episodes]), tool_calls=torch.tensor([e.calls for e in episodes]),
            tool_errors=torch.tensor([e.errors for e in episodes]),
            tool_seconds=torch.tensor([e.tool_seconds for e in episodes], dtype=torch.float64),
            final_text=[e.final_text for e in episodes], tool_wait_s=waited)
        return Rollout(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=policy.bool(),
            sampling_logprobs=right_pad([e.logprobs for e in episodes], 0.0, torch.float32),
            finish_reason=[e.finish for e in episodes], response_text=["".join(e.texts) for e in episodes],
            group_index=torch.arange(len(prompts)).repeat_interleave(n), group_size=n, pad_token_id=pad,
            context_mask=real & ~policy.bool(), episodes=info)
