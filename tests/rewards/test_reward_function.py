"""reward.function: user reward functions from a module or a file, per item or batched, run in the
verifier's killable workers (a hanging, raising or crashing call scores failure_value and is counted),
extra dataset columns arriving, and the reward-mode registry."""

from __future__ import annotations

import logging
import textwrap
import time
from pathlib import Path

import pytest

from stapo.rewards import (REWARD_MODES, CallableScorer, FunctionScorer, MathVerifier, available_reward_modes,
                           build_scorer, register_reward_mode)

pytestmark = pytest.mark.timeout(120)

REWARDS_PY = textwrap.dedent('''
    import os
    import time


    def exact(response, ground_truth):
        return 1.0 if response.strip() == ground_truth else 0.0


    def with_fields(response, ground_truth, difficulty):  # names one extra column only
        return float(difficulty) * (1.0 if response == ground_truth else -1.0)


    def troublesome(response, ground_truth):
        print("[0, 123.0]")  # stray stdout must not be read as a result
        if response == "hang":
            time.sleep(600)
        if response == "raise":
            return 1 / 0
        if response == "crash":
            os._exit(7)
        if response == "text":
            return "many"
        return 2.0


    def batched(responses, ground_truths, **columns):
        batched.seen = columns
        return [len(r) + len(columns.get("source", [])) for r in responses]


    def batched_columns(responses, ground_truths, source, tags=None, **rest):
        return [float(s == "gsm8k") + (len(t) if t else 0) for s, t in zip(source, tags)]


    def batched_short(responses, ground_truths):
        return [1.0]


    def batched_hang(responses, ground_truths):
        time.sleep(600)
''')


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_rewards") / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


@pytest.fixture()
def scorer(request, reward_file):
    """FunctionScorer on ``my_rewards.py:<param>`` (per item unless the name starts with batched)."""
    name = request.param
    s = FunctionScorer(f"{reward_file}:{name}", batched=name.startswith("batched"), timeout_s=1.0,
                       num_workers=2)
    yield s
    s.close()
    assert s.pool.pids() == []


@pytest.mark.parametrize("scorer", ["exact"], indirect=True)
def test_per_item_function_from_a_file(scorer):
    assert scorer.score(["4", " 5 ", "6"], ["4", "5", "7"]) == [1.0, 1.0, 0.0]
    assert scorer.failures == 0
    assert scorer(["x"], ["x"]) == [1.0]  # callable like the trainer's `score`


def test_module_path_and_named_fields(reward_file, monkeypatch, tmp_path):
    pkg = tmp_path / "pkg_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers import with this process's sys.path
    with FunctionScorer("pkg_rewards.scoring:with_fields", timeout_s=2.0, num_workers=1) as s:
        # difficulty 2 correct -> 2.0; difficulty 0.5 wrong -> -0.5; the column "source" is not named: not passed
        got = s.score(["a", "b"], ["a", "c"], [{"difficulty": 2, "source": "x"}, {"difficulty": 0.5, "source": "y"}])
    assert got == [2.0, -0.5]


@pytest.mark.parametrize("scorer", ["troublesome"], indirect=True)
def test_hanging_raising_and_crashing_calls_score_failure_value(scorer, caplog):
    scorer.pool.warmup()
    responses = ["ok", "hang", "raise", "crash", "text", "ok"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="stapo.rewards"):
        got = scorer.score(responses, ["-"] * 6)
    elapsed = time.monotonic() - start
    assert got == [2.0, -1.0, -1.0, -1.0, -1.0, 2.0]
    assert scorer.failures == 4
    assert elapsed < 1.0 + 4.0  # the hang costs one timeout (1 s), not 600 s; margin for 2 busy cores
    # one warning per call: the count and the first error (lowest index: the hang)
    assert "failed on 4 of 6 items (scored -1); first error: timed out after 1 s" in caplog.text
    # the pool recovered: a clean batch afterwards has no failures
    assert scorer.score(["ok"], ["-"]) == [2.0] and scorer.failures == 0


@pytest.mark.parametrize("scorer", ["troublesome"], indirect=True)
def test_each_failure_reason_is_reported(scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="stapo.rewards"):
        assert scorer.score(["raise"], ["-"]) == [-1.0]
        assert scorer.score(["crash"], ["-"]) == [-1.0]
        assert scorer.score(["text"], ["-"]) == [-1.0]
    assert "ZeroDivisionError: division by zero" in caplog.text
    assert "reward worker died (exit code 7)" in caplog.text
    assert "not a number" in caplog.text


@pytest.mark.parametrize("scorer", ["batched"], indirect=True)
def test_batched_function_gets_columns_as_lists(scorer):
    fields = [{"source": "gsm8k", "level": 1}, {"source": "math", "level": 5}, {"level": 3}]
    # len(response) + len(source column) = len(r) + 3
    assert scorer.score(["a", "bb", ""], ["1", "2", "3"], fields) == [4.0, 5.0, 3.0]
    assert scorer.score([], []) == [] and scorer.failures == 0


@pytest.mark.parametrize("scorer", ["batched_columns"], indirect=True)
def test_batched_function_named_columns_with_missing_values(scorer):
    fields = [{"source": "gsm8k", "tags": ["a", "b"]}, {"source": "math"}]  # row 2 lacks "tags": None
    assert scorer.score(["r1", "r2"], ["1", "2"], fields) == [3.0, 0.0]


WHY = {"batched_short": "returned 1 values for 2 responses", "batched_hang": "timed out after 1 s"}


@pytest.mark.parametrize("scorer", list(WHY), indirect=True)
def test_batched_failures_fail_the_whole_call(scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="stapo.rewards"):
        assert scorer.score(["a", "b"], ["1", "2"]) == [-1.0, -1.0]
    assert scorer.failures == 2
    assert WHY[scorer.spec.rpartition(":")[2]] in caplog.text


def test_bad_specs_fail_when_the_scorer_is_built(reward_file, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        FunctionScorer(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        FunctionScorer(f"{reward_file}:nope", num_workers=1)
    with pytest.raises(ValueError, match="ModuleNotFoundError"):
        FunctionScorer("no_such_module_xyz:f", num_workers=1)
    with pytest.raises(ValueError, match="must look like"):
        FunctionScorer("just_a_name")


def test_registry_builds_every_mode_and_lists_them(reward_file):
    assert available_reward_modes()[:4] == ["math", "dapo", "dapo_boxed", "function"]
    verifier = build_scorer("dapo_boxed")
    assert isinstance(verifier, MathVerifier) and verifier.mode == "dapo_boxed"
    assert verifier.score(["\\boxed{3}"], ["3"], [{"x": 1}]) == [1.0] and verifier.failures == 0
    verifier.close()
    with build_scorer("function", function=f"{reward_file}:exact", timeout_s=2.0) as fn_scorer:
        assert fn_scorer.score(["1"], ["1"]) == [1.0]
    with pytest.raises(ValueError, match="needs reward.function"):
        build_scorer("function")
    with pytest.raises(ValueError, match=r"choose one of \['math', 'dapo', 'dapo_boxed', 'function'\]"):
        build_scorer("bogus")


def test_registering_a_mode_makes_it_a_config_choice():
    from stapo.config import ConfigError, STAPOConfig

    with pytest.raises(ConfigError, match="reward.mode must be one of"):
        STAPOConfig.from_dict({}, ["reward.mode=neg_length"])

    @register_reward_mode("neg_length")
    def build(**_):
        return CallableScorer(lambda response, answer: -len(response))

    try:
        cfg = STAPOConfig.from_dict({}, ["reward.mode=neg_length"])
        assert build_scorer(cfg.reward.scorer_mode).score(["abc"], ["x"]) == [-3.0]
        with pytest.raises(ValueError, match="already registered"):
            register_reward_mode("math")(build)
    finally:
        del REWARD_MODES["neg_length"]


def test_callable_scorer_scores_failure_value_for_a_raising_item(caplog):
    scorer = CallableScorer(lambda response, answer, level=1: 1.0 / level, failure_value=-2.0)
    with caplog.at_level(logging.WARNING, logger="stapo.rewards"):
        assert scorer.score(["a", "b"], ["1", "2"], [{"level": 4}, {"level": 0}]) == [0.25, -2.0]
    assert scorer.failures == 1 and "ZeroDivisionError" in caplog.text


def test_config_and_cli_override_parse_the_function(reward_file):
    from stapo.config import STAPOConfig

    cfg = STAPOConfig.from_dict({}, [f"reward.function={reward_file}:exact", "reward.function_batched=false",
                                     "reward.failure_value=-0.5"])
    assert cfg.reward.function == f"{reward_file}:exact" and cfg.reward.scorer_mode == "function"
    # `stapo train reward.function=pkg.mod:fn`: the CLI splits the argument off and loads the recipe with it
    from stapo.cli import build_parser, builtin_recipe

    args = build_parser().parse_args(["train", "reward.function=pkg.mod:fn", "reward.function_batched=true"])
    cfg = STAPOConfig.from_yaml(builtin_recipe(), overrides=[args.config, *args.overrides])
    assert (cfg.reward.function, cfg.reward.function_batched) == ("pkg.mod:fn", True)


def test_the_documented_example_function():
    example = Path(__file__).resolve().parents[2] / "examples" / "reward_function.py"
    with FunctionScorer(f"{example}:boxed_with_level", timeout_s=5.0, num_workers=1) as s:
        # right at level 5: 1 + 5/5 = 2; right without a level column: 1 + 1/5 = 1.2; wrong: -1
        got = s.score(["so \\boxed{7}", "\\boxed{7}", "\\boxed{8}"], ["7", "7", "7"], [{"level": 5}, {}, {"level": 2}])
    assert got == pytest.approx([2.0, 1.2, -1.0])
