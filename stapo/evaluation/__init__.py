"""Evaluation with the STAPO paper's protocol (§5.1, App. D): avg@N and pass@k on math benchmarks;
docs/evaluation.md.

May import: ``stapo.distributed``, ``stapo.rollout``, ``stapo.rewards``, ``stapo.data`` and the
rest below them (docs/index.md, "Layout"); never the trainer.
"""

from stapo.evaluation.benchmarks import (BENCHMARKS, PAPER_SETTINGS, SETTING_GROUPS, BenchmarkPreset,
                                         DecodingSetting, get_benchmark, load_benchmark, local_benchmark)
from stapo.evaluation.cli import add_arguments, run_cli
from stapo.evaluation.metrics import avg_at_n, correct_counts, mean_pass_at_k, pass_at_k, pass_at_k_per_problem
from stapo.evaluation.report import BenchmarkResult, EvalReport
from stapo.evaluation.runner import build_engine, check_model_dir, evaluate_model, sample_benchmark

__all__ = [
    "BENCHMARKS", "PAPER_SETTINGS", "SETTING_GROUPS", "BenchmarkPreset", "BenchmarkResult", "DecodingSetting",
    "EvalReport", "add_arguments", "avg_at_n", "build_engine", "check_model_dir", "correct_counts",
    "evaluate_model", "get_benchmark", "load_benchmark", "local_benchmark", "mean_pass_at_k", "pass_at_k",
    "pass_at_k_per_problem", "run_cli", "sample_benchmark",
]
