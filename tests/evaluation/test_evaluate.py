"""evaluate_model with a scripted engine: reported avg@N / pass@k equal a direct count of the raw
generations re-scored here, per problem, per setting; the decoding settings reach the engine."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from stapo.evaluation import PAPER_SETTINGS, evaluate_model, load_benchmark, local_benchmark
from stapo.rewards import math_reward
from stapo.rollout.batch import Rollout, left_pad, right_pad

# Probability that a scripted sample is right, per problem (rows of the 4-problem file).
P_CORRECT = [0.0, 0.3, 0.7, 1.0]


class ScriptedEngine:
    """A RolloutEngine stand-in: for each prompt answers `\\boxed{answer}` with a per-problem
    probability, else `\\boxed{answer + 1}`; draws from `sampling.seed` only."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], tuple[str, float]]) -> None:
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate(self, prompt_ids, n, sampling) -> Rollout:
        self.calls.append((len(prompt_ids), n, sampling))
        rng = np.random.default_rng(sampling.seed)
        texts = []
        for prompt in prompt_ids:
            answer, p = self.answers[tuple(prompt)]
            for _ in range(n):
                guess = answer if rng.random() < p else str(int(answer) + 1)
                texts.append(f"Step by step. So the result is \\boxed{{{guess}}}")
        prompts, prompt_mask = left_pad([list(p) for p in prompt_ids for _ in range(n)], 0)
        lengths = [1 + len(t) % 5 for t in texts]
        response_ids = right_pad([[7] * m for m in lengths], 0, torch.long)
        return Rollout(prompt_ids=prompts, prompt_mask=prompt_mask, response_ids=response_ids,
                       response_mask=right_pad([[True] * m for m in lengths], False, torch.bool),
                       sampling_logprobs=torch.zeros(response_ids.shape), finish_reason=["stop"] * len(texts),
                       response_text=texts, group_index=torch.arange(len(prompt_ids)).repeat_interleave(n),
                       group_size=n)

    def load_weights(self, weights):  # pragma: no cover - the protocol's other methods
        raise NotImplementedError

    def sleep(self):  # pragma: no cover
        pass

    def wake(self):  # pragma: no cover
        pass


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
    # batch_rows = 4 with N = 2: two prompts per generate call, so 2 calls per setting.
    evaluate_model(tiny_model_dir, [preset], num_samples=2, max_new_tokens=77, engine=engine, seed=0,
                   batch_rows=4, cache_dir=tmp_path / "hf")
    assert [(p, n) for p, n, _ in engine.calls] == [(2, 2)] * 4
    used = [(s.temperature, s.top_p, s.max_new_tokens) for _, _, s in engine.calls]
    assert used == [(1.0, 1.0, 77)] * 2 + [(0.7, 0.9, 77)] * 2
    seeds = [s.seed for _, _, s in engine.calls]
    assert seeds[0] != seeds[1] and seeds[:2] == seeds[2:]  # per-chunk seeds, same across settings


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
