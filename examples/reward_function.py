"""A user reward function for `reward.function` (docs/grpo_options.md).

    stapo train examples/recipes/qwen3_8b_stapo.yaml reward.mode=function \
        reward.function=examples/reward_function.py:boxed_with_level
    stapo eval MODEL --data my.jsonl --reward-function examples/reward_function.py:boxed_with_level

It runs in stapo's reward worker processes: a call that raises or runs past `reward.timeout_s`
scores `reward.failure_value` and is counted in the `reward_failures` metric.
"""

from stapo.rewards import extract_answer


def boxed_with_level(response: str, ground_truth: str, level: int = 1) -> float:
    """+1 for the right boxed answer, -1 otherwise; hard problems (the dataset's `level` column,
    passed because this function names it) earn up to twice as much."""
    correct = extract_answer(response) == ground_truth.strip()
    return (1.0 + min(level, 5) / 5) if correct else -1.0
