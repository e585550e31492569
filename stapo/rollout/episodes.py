"""Tool episodes: what turns a sample's segments into a multi-turn, tool-integrated episode (docs/tir.md,
"How an episode runs"). A turn a weight sync cut continues with its next segment; a stop string the cut split
in two is found across the cut (`read`), so the turn ends where an uncut one would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from stapo.rollout.engine import Segment, eos_token_ids
from stapo.rollout.sampling import SamplingParams
from stapo.rollout.tool_turns import ToolTurnRenderer
from stapo.rollout.trajectory import Trajectory
from stapo.tools import Tool, ToolCallParser, ToolResult, run_tool_calls

__all__ = ["ToolEpisodes"]


class ToolEpisodes:
    """The tools of an episode (by name, `stapo.tools.build_tool`), its call format (``parser``) and how its turns
    are read and answered; ``template_kwargs``: the prompts' chat-template arguments (e.g. ``enable_thinking``)."""

    def __init__(self, tokenizer, parser: ToolCallParser, tools: Mapping[str, Tool], *, max_turns: int,
                 max_workers: int = 8, template_kwargs: dict | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"ToolEpisodes needs max_turns >= 1, got {max_turns}")
        self.tokenizer, self.parser, self.tools = tokenizer, parser, dict(tools)
        self.max_turns, self.max_workers = max_turns, max_workers
        self.renderer = ToolTurnRenderer(tokenizer, parser, template_kwargs)
        self.eos_ids = set(eos_token_ids(tokenizer))
        added = tokenizer.get_added_vocab()  # a stop tag that is one added token also stops by id
        self.stop_ids = tuple(added[s] for s in parser.stop if s in added)

    def sampling(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` plus the parser's stop strings and ids."""
        return replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *self.parser.stop))),
                       stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *self.stop_ids))))

    def end_turn(self, t: Trajectory) -> None:
        """A turn that stopped: the final answer, or calls for the next tool turn (or, on the last turn, the end)."""
        parsed = self.parser.parse(t.end_turn())
        if parsed.final:
            t.close("stop")
            return
        t.calls += max(len(parsed.calls), 1)  # a malformed call counts as one failed call
        if t.turns >= self.max_turns:
            t.close("length")  # out of turns with a call pending: no turn is left to read its result
        else:
            t.pending = parsed

    def tool_turns(self, trajectories: Sequence[Trajectory], budget: int) -> None:
        """Run the pending calls of every episode, then append each one's tool turn as context."""
        pending = [t for t in trajectories if t.pending is not None]
        for t, results in zip(pending, self._run_calls(pending), strict=True):
            t.pending = None
            t.errors += sum(r.error for r in results)
            t.tool_seconds += sum(r.seconds for r in results)
            last = t.tokens[-1] if t.tokens else None
            after_eos = self.tokenizer.decode([last]) if last in self.eos_ids else ""
            text = self.renderer.text([r.text for r in results], after_eos)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(t.tokens) + len(ids) + 1 > budget:  # no room left for a policy token after it
                t.close("length")
            else:
                t.add_context(ids, text)

    def _run_calls(self, pending: list[Trajectory]) -> list[list[ToolResult]]:
        """Each episode's results in call order: all calls run together, one session per (episode, tool);
        a malformed turn or an unknown tool gets its error message as the result."""
        jobs, slots = [], []
        results: list[list] = []
        for b, t in enumerate(pending):
            if t.pending.error is not None:
                results.append([ToolResult(t.pending.error, True, 0.0)])
                continue
            results.append([None] * len(t.pending.calls))
            for k, call in enumerate(t.pending.calls):
                tool = self.tools.get(call.name)
                if tool is None:
                    results[b][k] = ToolResult(f"unknown tool {call.name!r}; available tools: "
                                               f"{', '.join(sorted(self.tools))}", True, 0.0)
                    continue
                if call.name not in t.sessions:
                    t.sessions[call.name] = tool.open_session()
                jobs.append((tool, call, t.sessions[call.name]))
                slots.append((b, k))
        for (b, k), result in zip(slots, run_tool_calls(jobs, self.max_workers) if jobs else []):
            results[b][k] = result
        return results

    def read(self, before: str, segment: Segment) -> Segment:
        """``segment`` as the episode reads it: its text decoded here from its tokens (what the parser and the
        verifier see, whatever an engine's own text leaves out) and, when it continues a turn a sync cut (whose
        text so far is ``before``), cut at a stop string that began before the cut: the engine checked its stop
        strings in the new text only."""
        text = self.tokenizer.decode(segment.tokens, skip_special_tokens=True)
        stops = self.parser.stop
        width = max(map(len, stops), default=1) - 1  # a stop string split by the cut has this much before it
        head = before[len(before) - width:] if width else ""
        if head and any(0 <= (head + text).find(s) < len(head) for s in stops):
            for k in range(1, len(segment.tokens) + 1):
                cut = self.tokenizer.decode(segment.tokens[:k], skip_special_tokens=True)
                if any(s in head + cut for s in stops):
                    return Segment(segment.tokens[:k], segment.logprobs[:k], cut, "stop", segment.version)
        return replace(segment, text=text)
