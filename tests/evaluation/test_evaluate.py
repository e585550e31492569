"""evaluate_model with a scripted engine: reported avg@N / pass@k equal a direct count of the raw
generations re-scored here, per problem, per setting; the decoding settings reach the engine."""

from __future__ import annotations

import contextlib
import itertools
import json

import numpy as np
import pytest

from stapo.evaluation import PAPER_SETTINGS, evaluate_model, load_benchmark, local_benchmark
from stapo.rewards import math_reward
from stapo.rollout import RolloutEngine, Segment
from stapo.rollout.sampling import derived_seed
from stapo.rollout.trajectory import prompt_seeds

# Probability that a scripted sample is right, per problem (rows of the 4-problem file).
P_CORRECT = [0.0, 0.3, 0.7, 1.0]


class ScriptedEngine(RolloutEngine):
    """A rollout engine for the test: for each request answers `\\boxed{answer}` with a per-problem
    probability, else `\\boxed{answer + 1}`; draws from the request's seed only."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], tuple[str, float]]) -> None:
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate_segments(self, requests, sampling):
        self.calls.append((list(requests), sampling))
        out = []
        for r in requests:
            answer, p = self.answers[tuple(r.context)]
            guess = answer if np.random.default_rng(r.seed).random() < p else str(int(answer) + 1)
            text = f"Step by step. So the result is \\boxed{{{guess}}}"
            out.append(Segment([7] * (1 + len(text) % 5), [0.0] * (1 + len(text) % 5), text, "stop"))
        return out

    def weight_update(self, version=None):  # pragma: no cover - the contract's other methods
        return contextlib.nullcontext()

    def load_weights(self, weights):  # pragma: no cover
        raise NotImplementedError


@pytest.fixture()
def scripted(tiny_tokenizer, arithmetic_file, tmp_path):
    preset = local_benchmark(arithmetic_file, name="arith")
    dataset = load_benchmark(preset, tiny_tokenizer, cache_dir=tmp_path / "hf")
    answers = {tuple(e.prompt_ids): (e.ground_truth, P_CORRECT[i]) for i, e in enumerate(dataset)}
    return preset, ScriptedEngine(tiny_tokenizer, answers)


def brute_pass_at_k(verdicts: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(verdicts, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_reported_metrics_equal_direct_count_of_rescored_generations(scripted, tiny_model_dir, tmp_path):
    preset, engine = scripted
    report = evaluate_model(tiny_model_dir, [preset], num_samples=8, max_new_tokens=33, engine=engine, seed=5,
                            pass_k=(1, 2, 8, 16), cache_dir=tmp_path / "hf")
    assert [r.setting for r in report.results] == list(PAPER_SETTINGS)
    saw_mixed = False
    for result in report.results:
        assert result.num_problems == 4 and result.num_samples == 8
        assert result.problem_index == [0, 1, 2, 3]
        # Re-score every raw generation with the scalar reward, independently of the batch verifier.
        verdicts = [[math_reward(text, gt) == 1.0 for text in texts]
                    for texts, gt in zip(result.responses, result.ground_truth, strict=True)]
        counts = [sum(v) for v in verdicts]
        assert result.correct_counts.tolist() == counts
        assert result.avg_at_n == pytest.approx(sum(counts) / (4 * 8))
        for k in (1, 2, 8):
            assert result.pass_at[k] == pytest.approx(np.mean([brute_pass_at_k(v, k) for v in verdicts]))
        assert 16 not in result.pass_at  # k > N is skipped
        assert counts[0] == 0 and counts[3] == 8  # p = 0 and p = 1 problems
        saw_mixed |= any(0 < c < 8 for c in counts)
    assert saw_mixed, "the scripted engine should give some problems a mix of right and wrong samples"
    expected_avg = np.mean([r.avg_at_n for r in report.results if r.setting.name == "train"])
    assert report.average("train") == pytest.approx(expected_avg)

    # JSON holds the same per-problem counts, settings, N and model path.
    paths = report.write(tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["model"] == str(tiny_model_dir)
    assert [s["temperature"] for s in data["settings"]] == [1.0, 0.7]
    assert [s["top_p"] for s in data["settings"]] == [1.0, 0.9]
    for got, result in zip(data["results"], report.results, strict=True):
        assert got["num_samples"] == 8
        assert [p["correct"] for p in got["per_problem"]] == result.correct_counts.tolist()
        assert got["avg_at_n"] == pytest.approx(result.avg_at_n)
    samples = [json.loads(line) for line in paths["samples"].read_text().splitlines()]
    assert len(samples) == 2 * 4 and all(len(s["responses"]) == 8 for s in samples)


def test_decoding_settings_and_budget_reach_the_engine(scripted, tiny_model_dir, tmp_path):
    preset, engine = scripted
    # batch_rows = 4 with N = 2: two prompts per chunk, 2 chunks per setting, submitted together
    evaluate_model(tiny_model_dir, [preset], num_samples=2, max_new_tokens=77, engine=engine, seed=0,
                   batch_rows=4, cache_dir=tmp_path / "hf")
    assert [len(requests) for requests, _ in engine.calls] == [8] * 2  # one submission per setting
    used = [(s.temperature, s.top_p) for _, s in engine.calls]
    assert used == [(1.0, 1.0), (0.7, 0.9)]
    assert all(r.max_new_tokens == 77 for requests, _ in engine.calls for r in requests)
    seeds = [[r.seed for r in requests] for requests, _ in engine.calls]
    # a chunk's seeds derive from its first problem only (0 and 2): per-chunk seeds, the same across settings
    chunks = [prompt_seeds(derived_seed(0, first), 2) for first in (0, 2)]
    assert seeds[0] == seeds[1] == [s + k for chunk in chunks for s in chunk for k in range(2)]


def test_preset_n_is_the_default_and_samples_override(scripted, tiny_model_dir, tmp_path):
    preset, engine = scripted
    report = evaluate_model(tiny_model_dir, [preset], settings=PAPER_SETTINGS[:1], engine=engine,
                            max_new_tokens=8, cache_dir=tmp_path / "hf")
    assert report.results[0].num_samples == preset.num_samples == 4  # local files default to N = 4
    math500 = local_benchmark(preset.hf_name, name="math500", prompt_field="problem")
    assert (math500.num_samples, math500.answer_field, math500.split) == (4, "answer", "test")
    aime = local_benchmark(preset.hf_name, name="aime24")
    assert aime.num_samples == 32 and aime.is_local


def test_a_user_reward_function_judges_with_extra_columns(tiny_tokenizer, tiny_model_dir, tmp_path):
    from stapo.tiny import arithmetic_problems

    problems = arithmetic_problems(4, seed=3)
    rows = [{"problem": p.question, "answer": p.answer, "level": i} for i, p in enumerate(problems)]
    data = tmp_path / "levels.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    preset = local_benchmark(str(data), name="levels")
    dataset = load_benchmark(preset, tiny_tokenizer, cache_dir=tmp_path / "hf")
    engine = ScriptedEngine(tiny_tokenizer, {tuple(e.prompt_ids): (e.ground_truth, P_CORRECT[i])
                                             for i, e in enumerate(dataset)})
    judge = tmp_path / "judge.py"  # right AND level >= 2 (the extra column) -> +1; else -1 (not > 0)
    judge.write_text("def judge(response, ground_truth, level):\n"
                     "    return 1.0 if '{' + ground_truth + '}' in response and level >= 2 else -1.0\n")
    report = evaluate_model(tiny_model_dir, [preset], settings=PAPER_SETTINGS[:1], num_samples=8, max_new_tokens=8,
                            engine=engine, reward_function=f"{judge}:judge", cache_dir=tmp_path / "hf")
    (result,) = report.results
    math_counts = [sum(math_reward(t, gt) == 1.0 for t in texts)
                   for texts, gt in zip(result.responses, result.ground_truth, strict=True)]
    assert result.correct_counts.tolist() == [0, 0, math_counts[2], 8]  # levels 0 and 1 never count
    assert math_counts[1] > 0 or math_counts[2] > 0  # the scripted engine did give right answers


def test_reward_mode_reaches_the_judge(scripted, tiny_model_dir, tmp_path):
    preset, engine = scripted
    # `dapo` reads only "Answer:" lines; the scripted responses only box their answers: nothing is correct
    report = evaluate_model(tiny_model_dir, [preset], settings=PAPER_SETTINGS[:1], num_samples=4, max_new_tokens=8,
                            engine=engine, reward_mode="dapo", cache_dir=tmp_path / "hf")
    assert report.results[0].correct_counts.tolist() == [0, 0, 0, 0]
