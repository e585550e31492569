"""``rollout.tools`` end to end in the trainer (docs/tir.md): the tiny TIR model (tests/conftest.py) runs
two-turn episodes with the real calculator; the knobs reach the run, the tool metrics are logged, the
verifier reads the final turn, and the tool shaping is what the episodes earned."""

from __future__ import annotations

import math

import pytest
import torch

from stapo.config import ConfigError, STAPOConfig
from stapo.rewards import build_reward_term, reward_penalty
from stapo.rollout import Rollout
from stapo.rollout.batch import EpisodeInfo
from stapo.run_dir import read_metrics
from stapo.telemetry.metrics import OPTIONAL_METRIC_KEYS, STEP_METRIC_KEYS

TOOL_KEYS = ("turns_mean", "tool_calls_mean", "tool_errors_mean", "tool_error_frac", "context_token_frac",
             "tool_penalty_mean", "time_tools")


def _rollout(episodes: EpisodeInfo | None, b: int = 4) -> Rollout:
    """``b`` rows; row 0 holds policy, context, context, policy tokens (4 real tokens, 2 sampled)."""
    response_mask = torch.zeros(b, 4, dtype=torch.bool)
    response_mask[:, 0] = True
    response_mask[0, 3] = True
    context = torch.zeros(b, 4, dtype=torch.bool)
    context[0, 1:3] = True
    ones = torch.ones(b, 1, dtype=torch.long)
    return Rollout(ones, ones.bool(), torch.ones(b, 4, dtype=torch.long), response_mask, torch.zeros(b, 4),
                   ["stop"] * b, [""] * b, torch.arange(b) // 2, 2, context_mask=context, episodes=episodes)


def test_tool_shaping_is_per_error_and_per_call_beyond_the_budget():
    info = EpisodeInfo(turns=torch.tensor([3, 1, 2, 1]), tool_calls=torch.tensor([3, 0, 1, 2]),
                       tool_errors=torch.tensor([1, 0, 1, 0]), tool_seconds=torch.zeros(4, dtype=torch.float64),
                       final_text=["", "", "", ""])
    rollout = _rollout(info)
    tool = build_reward_term("tool", error_penalty=0.5, call_budget=1, call_penalty=0.25)
    terms = [build_reward_term("overlong", max_response_length=8), tool]
    # row 0: 1 error (-0.5) and 2 calls beyond 1 (-0.5) = -1.0; row 2: -0.5; row 3: 1 call beyond = -0.25
    assert tool(rollout).tolist() == [-1.0, 0.0, -0.5, -0.25]
    total, sums = reward_penalty(rollout, terms)
    assert total.tolist() == [-1.0, 0.0, -0.5, -0.25]
    assert sums == {"overlong_penalty_sum": 0.0, "tool_penalty_sum": -1.75}
    single = _rollout(None, b=2)
    assert tool(single).tolist() == [0.0, 0.0] and reward_penalty(single, terms)[1]["tool_penalty_sum"] == 0.0
    # DAPO's overlong penalty counts an episode's context tokens: the budget bounds policy + context.
    # Buffer 2 of 4: the penalty starts after 2 tokens, -1 at 4; row 0 (4 real tokens, 2 sampled): -1
    overlong = build_reward_term("overlong", max_response_length=4, buffer=2, penalty=1.0)
    assert overlong(rollout).tolist() == [-1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.tools.names=[nope]"], "rollout.tools: unknown tool 'nope'"),
    (["rollout.tools.parser=xml"], "rollout.tools.parser: unknown parser 'xml'"),
    (["rollout.tools.names=[calculator]", "rollout.tools.params={python: {x: 1}}"], "does not list"),
    (["rollout.tools.max_turns=0"], "rollout.tools.max_turns must be >= 1"),
    (["reward.tool_call_penalty=-1"], "reward.tool_call_penalty must be finite and >= 0"),
    (["reward.tool_call_budget=-1"], "reward.tool_call_budget must be >= 0"),
    (["rollout.tools.error_penalty=0.5"], "rollout.tools.error_penalty=0.5 is reward.tool_error_penalty now: "
                                          "write reward.tool_error_penalty=0.5"),
    (["tiny.task=chess"], "tiny.task must be one of"),
    (["rollout.tools.names=[calculator]", "rollout.tools.params={calculator: {digits: 3}}"],
     r"rollout.tools.params.calculator: unknown parameter\(s\) \['digits'\]"),
    (["rollout.tools.names=[python]", "rollout.tools.params={python: {backend: sandbox_fusion}}"],
     "rollout.tools.params.python: python tool: backend='sandbox_fusion' needs url"),
    (["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "rollout.tools needs rollout.tensor_parallel_size 1"),
])
def test_invalid_tool_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_yaml(None, ["rollout.tools.enabled=true", *overrides])


@pytest.mark.slow
def test_a_run_with_tools_logs_episodes_and_evaluates_with_and_without_tools(tmp_path, tir_model_dir):
    from stapo import STAPOTrainer

    out = tmp_path / "run"
    cfg = STAPOConfig.from_yaml(None, [
        f"model.path={tir_model_dir}", "data.source=builtin:arithmetic", "tiny.task=tir", "data.eval_size=8",
        "data.num_builtin_problems=64", f"trainer.output_dir={out}", "trainer.train_batch_size=4",
        "trainer.mini_batch_size=2", "trainer.micro_batch_size=8", "rollout.group_size=4",
        "rollout.max_response_length=64", "trainer.total_steps=2", "optim.lr=1e-3", "optim.warmup_steps=0",
        "rollout.engine=hf", "rollout.tools.enabled=true", "rollout.tools.names=[calculator]",
        "rollout.tools.max_turns=3", "rollout.tools.eval_without_tools=true", "reward.tool_call_penalty=0.1",
        "rollout.tools.params={calculator: {max_digits: 40}}", "logging.progress=false",
        "logging.tensorboard=false", "trainer.save_every=0", "trainer.export_hf=false", "logging.plot=false",
        "inspect.record_every=1"])
    trainer = STAPOTrainer(cfg)
    assert trainer.rollouts.tools is not None and trainer.rollouts.tools.max_turns == 3
    assert trainer.rollouts.tools.tools["calculator"].max_digits == 40  # rollout.tools.params reached the tool
    assert "Tools: calculator" in trainer.train_data[0].prompt_text  # the prompts offer the tools
    assert "Tools:" not in trainer.eval_data_without_tools[0].prompt_text
    trainer.train()
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert len(steps) == 2 and len(evals) == 2
    for row in steps:
        assert all(k in row for k in STEP_METRIC_KEYS + TOOL_KEYS)
        assert not set(row) - set(STEP_METRIC_KEYS) - set(OPTIONAL_METRIC_KEYS)
        assert row["tool_calls_mean"] > 0 and 0 < row["context_token_frac"] < 1 and row["turns_mean"] > 1
        assert 0 < row["control_token_frac"] < 1 and 0 < row["control_token_prob"] <= 1  # <tool_call>, </tool_call>
        assert row["tool_penalty_mean"] == pytest.approx(-0.1 * row["tool_calls_mean"])  # call_budget 0
        assert all(math.isfinite(row[k]) for k in TOOL_KEYS)
    for row in evals:
        assert {"eval_tool_calls_mean", "eval_no_tools_accuracy", "eval_no_tools_response_length_mean"} <= set(row)
    from stapo.inspect.records import load_records

    records = load_records(out)
    episodes = [r for rec in records for r in rec.rows if r.context]
    assert episodes and all("<tool_response>" in text for r in episodes for _, text in r.context)
