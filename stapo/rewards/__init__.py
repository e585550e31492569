"""Rule-based math reward (paper §2.1): +1 for a correct final answer, -1 otherwise; docs/rewards.md.
Light to import: sympy runs only in the verifier's worker processes.

May import: ``stapo.registry`` and the standard library (docs/index.md, "Layout").
"""

from stapo.rewards.extract import extract_answer
from stapo.rewards.modes import REWARD_MODES, available_reward_modes, build_scorer, register_reward_mode
from stapo.rewards.normalize import normalize_answer
from stapo.rewards.scorers import CallableScorer, FunctionScorer, Scorer
from stapo.rewards.terms import (REWARD_TERMS, RewardTerm, build_reward_term, overlong_penalty, register_reward_term,
                                 reward_penalty)
from stapo.rewards.verifier import MODES, MathVerifier, math_reward, verify

__all__ = ["MODES", "REWARD_MODES", "REWARD_TERMS", "CallableScorer", "FunctionScorer", "MathVerifier", "RewardTerm",
           "Scorer", "available_reward_modes", "build_reward_term", "build_scorer", "extract_answer", "math_reward",
           "normalize_answer", "overlong_penalty", "register_reward_mode", "register_reward_term", "reward_penalty",
           "verify"]
