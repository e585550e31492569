"""Run a batch of tool calls concurrently, bounded, results in the calls' order (docs/tools.md, "The contract").

A pure-Python tool's thread cannot be stopped from outside and is left behind past ``deadline_s`` (a daemon),
so such tools must bound their own work, as ``calculator`` does.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

from stapo.tools.base import Tool, ToolCall, ToolResult, ToolSession

__all__ = ["run_tool_calls"]

Job = tuple[Tool, ToolCall, Optional[ToolSession]]


def _chains(jobs: Sequence[Job]) -> list[list[int]]:
    """Job indices grouped so that jobs sharing a session form one chain, in their order."""
    chains, by_session = [], {}
    for i, (_, _, session) in enumerate(jobs):
        if session is None:
            chains.append([i])
        elif id(session) in by_session:
            by_session[id(session)].append(i)
        else:
            by_session[id(session)] = [i]
            chains.append(by_session[id(session)])
    return chains


def run_tool_calls(jobs: Sequence[Job], max_workers: int = 8) -> list[ToolResult]:
    """``ToolResult`` of each ``(tool, call, session)`` job, in order; never raises for a call."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    results: list[Optional[ToolResult]] = [None] * len(jobs)
    chains = _chains(jobs)
    lock = threading.Condition()
    next_chain = [0]
    started: dict[int, float] = {}  # job index -> start time, while it runs

    def worker() -> None:
        while True:
            with lock:
                if next_chain[0] >= len(chains):
                    return
                chain = chains[next_chain[0]]
                next_chain[0] += 1
            for i in chain:
                tool, call, session = jobs[i]
                with lock:
                    if results[i] is not None:  # timed out while an earlier link ran: skip the rest
                        continue
                    started[i] = time.monotonic()
                result = tool(call.arguments, session)
                with lock:
                    started.pop(i, None)
                    if results[i] is None:
                        results[i] = result
                    lock.notify_all()

    def spawn() -> None:
        threading.Thread(target=worker, name="stapo-tool-call", daemon=True).start()

    for _ in range(min(max_workers, len(chains))):
        spawn()
    with lock:
        while any(r is None for r in results):
            now, wake = time.monotonic(), 1.0
            for i, t0 in list(started.items()):
                limit = jobs[i][0].deadline_s
                if now - t0 >= limit:  # a stuck call: report it, give its slot to a new worker
                    results[i] = ToolResult(f"{jobs[i][1].name}: timed out after {limit:g} s", True, now - t0)
                    started.pop(i)
                    _fail_rest_of_chain(i, chains, jobs, results)
                    spawn()
                else:
                    wake = min(wake, limit - (now - t0))
            lock.wait(timeout=max(wake, 0.01))
    return results


def _fail_rest_of_chain(i: int, chains: list[list[int]], jobs: Sequence[Job], results: list) -> None:
    """The later calls of a stuck call's session cannot run (the session is busy): error them."""
    chain = next(c for c in chains if i in c)
    for j in chain[chain.index(i) + 1:]:
        if results[j] is None:
            results[j] = ToolResult(f"{jobs[j][1].name}: not run, an earlier call of this session timed out",
                                    True, 0.0)
