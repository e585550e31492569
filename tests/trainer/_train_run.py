"""A training run in its own process, for the kill/resume test: ``python _train_run.py CONFIG``."""

import sys

from _rewards import digit_one_reward

from stapo import STAPOConfig, STAPOTrainer


if __name__ == "__main__":
    STAPOTrainer(STAPOConfig.from_yaml(sys.argv[1]), reward_fn=digit_one_reward).train()
