"""Rewards for trainer tests on a random tiny model, which answers every problem wrong: these depend on
what was sampled or on call order, so groups have mixed rewards and updates are non-zero."""


def digit_one_reward(response: str, ground_truth: str) -> float:
    return 1.0 if "1" in response else -1.0


def alternating_reward():
    """+1, -1, +1, ... in call order, whatever was sampled: with an even group size every group has
    mixed rewards, so every mini-batch updates on any device (greedy-ish GPU sampling can make "has
    the digit 1" equal across a whole group). A step scores an even number of responses, so a resumed
    run continues the same sequence."""
    calls = {"n": 0}

    def reward(response: str, ground_truth: str) -> float:
        calls["n"] += 1
        return 1.0 if calls["n"] % 2 else -1.0

    return reward
