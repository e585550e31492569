"""``rollout.tools`` and ``tiny.task: tir`` as components (docs/tir.md): the tools, the episodes'
:class:`~stapo.rollout.episodes.ToolEpisodes`, and the tiny TIR demo's model and problems.
"""

from __future__ import annotations

import logging

from stapo.config import STAPOConfig

log = logging.getLogger("stapo.trainer")

__all__ = ["build_tools", "tool_schemas", "tool_episodes", "control_token_ids", "build_tiny_tir_model",
           "tiny_tir_rows"]


def build_tools(cfg: STAPOConfig, *, note: bool = False) -> dict:
    """``{name: Tool}`` of ``rollout.tools.names`` (empty when tools are off); ``note``: log each shared limit
    that a tool's own ``params`` replace."""
    from stapo.tools import build_tool

    t = cfg.rollout.tools
    tools = {}
    for name in t.names if t.enabled else ():
        params, notes = t.settings_of(name)
        for line in notes if note else ():
            log.info(line)
        tools[name] = build_tool(name, **params)
    return tools


def tool_schemas(cfg: STAPOConfig) -> list[dict] | None:
    """The schemas the prompts' chat template lists (None when tools are off)."""
    tools = build_tools(cfg)
    return [tool.schema() for tool in tools.values()] or None


def tool_episodes(cfg: STAPOConfig, tokenizer):
    """What makes every rollout row an episode with ``rollout.tools``; None when tools are off."""
    t = cfg.rollout.tools
    if not t.enabled:
        return None
    from stapo.rollout.episodes import ToolEpisodes
    from stapo.tools import build_tool_parser

    return ToolEpisodes(tokenizer, build_tool_parser(t.parser, tools=tuple(t.names)), build_tools(cfg, note=True),
                        max_turns=t.max_turns, max_workers=t.max_workers)


def control_token_ids(episodes):
    """The call format's tags that are single tokens of the episodes' tokenizer (``<tool_call>``), counted for
    the health monitors (docs/health.md); None without tool episodes or such tags."""
    if episodes is None:
        return None
    import torch

    added = episodes.tokenizer.get_added_vocab()
    ids = [added[tag] for tag in episodes.parser.control if tag in added]
    return torch.tensor(ids, dtype=torch.long) if ids else None


def build_tiny_tir_model(cfg: STAPOConfig, progress: bool) -> str:
    """The TIR demo's model: its own tokenizer, a random-init tiny Qwen3 on it, its warm start."""
    from stapo.tiny import build_tiny_model
    from stapo.tiny.tir import build_tir_tokenizer, tir_problems, tir_warm_start
    from stapo.tiny.warmstart import DEFAULT_TRAIN_SEED

    path = build_tiny_model(seed=cfg.tiny.seed, tokenizer_dir=build_tir_tokenizer())
    if cfg.tiny.warm_start_steps > 0:
        path = tir_warm_start(path, tir_problems(4000, seed=DEFAULT_TRAIN_SEED),
                              tool_fraction=cfg.tiny.warm_start_tool_fraction, steps=cfg.tiny.warm_start_steps,
                              lr=cfg.tiny.warm_start_lr, seed=cfg.tiny.seed, progress=progress)
    return str(path)


def tiny_tir_rows(n: int, seed: int) -> list[dict]:
    """``builtin:arithmetic`` rows of the TIR task."""
    from stapo.tiny.tir import tir_problems

    return [{"prompt": p.question, "answer": p.answer} for p in tir_problems(n, seed=seed)]
