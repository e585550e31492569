"""Evaluation results: typed per-(benchmark, setting) results, the Markdown table, the JSON file.

`EvalReport.write(out_dir)` writes `results.md`, `results.json` and, when the responses were kept,
`samples.jsonl` (docs/evaluation.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stapo.evaluation.benchmarks import BenchmarkPreset, DecodingSetting
from stapo.evaluation.metrics import avg_at_n, correct_counts, mean_pass_at_k
from stapo.run_dir import write_text_atomic

__all__ = ["BenchmarkResult", "EvalReport"]


@dataclass
class BenchmarkResult:
    """N sampled responses per problem of one benchmark under one decoding setting; P problems."""

    benchmark: str
    setting: DecodingSetting
    correct: np.ndarray  # (P, N) bool, the verdict of sample j of problem i
    response_lengths: np.ndarray  # (P, N) int, generated tokens (EOS included)
    truncated: np.ndarray  # (P, N) bool, the response hit max_new_tokens
    problem_index: list[int]  # row indices in the source split
    ground_truth: list[str]
    responses: list[list[str]] = field(default_factory=list)  # P lists of N texts (empty when not kept)
    pass_k: tuple[int, ...] = (1,)  # the k of pass@k to report (those > N are skipped)
    tool_calls: np.ndarray | None = None  # (P, N) int per episode (`stapo eval --tools`), else None
    tool_errors: np.ndarray | None = None  # (P, N) int, failed calls per episode

    @property
    def num_problems(self) -> int:
        return int(self.correct.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.correct.shape[1])

    @property
    def avg_at_n(self) -> float:
        return avg_at_n(self.correct)

    @property
    def correct_counts(self) -> np.ndarray:
        """(P,) int, correct samples per problem."""
        return correct_counts(self.correct)

    @property
    def pass_at(self) -> dict[int, float]:
        """{k: mean pass@k} for the requested k <= N."""
        return {k: mean_pass_at_k(self.correct, k) for k in self.pass_k if k <= self.num_samples}

    def to_dict(self) -> dict:
        counts = self.correct_counts.tolist()
        return {
            "benchmark": self.benchmark, "setting": self.setting.name,
            "temperature": self.setting.temperature, "top_p": self.setting.top_p,
            "num_problems": self.num_problems, "num_samples": self.num_samples,
            "avg_at_n": self.avg_at_n, "pass_at_k": {str(k): v for k, v in self.pass_at.items()},
            "mean_response_length": float(self.response_lengths.mean()) if self.response_lengths.size else 0.0,
            "truncated_frac": float(self.truncated.mean()) if self.truncated.size else 0.0,
            **({} if self.tool_calls is None else {"tool_calls_mean": float(self.tool_calls.mean()),
                                                   "tool_errors_mean": float(self.tool_errors.mean())}),
            "per_problem": [{"index": i, "ground_truth": gt, "correct": c}
                            for i, gt, c in zip(self.problem_index, self.ground_truth, counts, strict=True)],
        }


@dataclass
class EvalReport:
    """All results of one `evaluate_model` call (paper Table 2 layout: benchmarks × settings)."""

    model_path: str
    engine: str
    benchmarks: list[BenchmarkPreset]
    settings: tuple[DecodingSetting, ...]
    max_new_tokens: int
    seed: int
    results: list[BenchmarkResult]
    seconds: float = 0.0

    def result(self, benchmark: str, setting: str) -> BenchmarkResult:
        for r in self.results:
            if r.benchmark == benchmark and r.setting.name == setting:
                return r
        raise KeyError(f"no result for benchmark {benchmark!r} under setting {setting!r}")

    def average(self, setting: str) -> float:
        """Unweighted mean of the benchmarks' avg@N under `setting` (the paper's "Avg" column)."""
        values = [r.avg_at_n for r in self.results if r.setting.name == setting]
        return float(np.mean(values)) if values else float("nan")

    def average_pass_at(self, setting: str) -> dict[int, float]:
        """Mean pass@k over benchmarks, for the k every benchmark reports."""
        rows = [r.pass_at for r in self.results if r.setting.name == setting]
        common = set.intersection(*(set(p) for p in rows)) if rows else set()
        return {k: float(np.mean([p[k] for p in rows])) for k in sorted(common)}

    def to_dict(self) -> dict:
        return {
            "model": self.model_path, "engine": self.engine, "max_new_tokens": self.max_new_tokens,
            "seed": self.seed, "seconds": self.seconds,
            "settings": [dataclasses.asdict(s) for s in self.settings],
            "benchmarks": [{**dataclasses.asdict(b), "num_problems": self.result(b.name, self.settings[0].name)
                            .num_problems} for b in self.benchmarks],
            "average": {s.name: {"avg_at_n": self.average(s.name),
                                 "pass_at_k": {str(k): v for k, v in self.average_pass_at(s.name).items()}}
                        for s in self.settings},
            "results": [r.to_dict() for r in self.results],
        }

    def markdown(self) -> str:
        """avg@N table (benchmarks × settings, plus the average) and a pass@k / length table, in %."""
        head = ["benchmark", "N", "problems"] + [f"avg@N ({s.label})" for s in self.settings]
        lines = [f"Model: `{self.model_path}`  (engine: {self.engine}, max new tokens: {self.max_new_tokens}, "
                 f"seed: {self.seed})", "", _row(head), _row(["---"] * len(head))]
        for b in self.benchmarks:
            first = self.result(b.name, self.settings[0].name)
            lines.append(_row([b.name, str(first.num_samples), str(first.num_problems)]
                              + [_pct(self.result(b.name, s.name).avg_at_n) for s in self.settings]))
        lines.append(_row(["**average**", "", ""] + [f"**{_pct(self.average(s.name))}**" for s in self.settings]))
        ks = sorted({k for r in self.results for k in r.pass_at})
        tools = any(r.tool_calls is not None for r in self.results)
        head = ["benchmark", "setting"] + [f"pass@{k}" for k in ks] + ["mean length", "truncated"] \
            + (["tool calls / episode", "tool errors / episode"] if tools else [])
        lines += ["", _row(head), _row(["---"] * len(head))]
        for r in self.results:
            d = r.to_dict()
            lines.append(_row([r.benchmark, r.setting.name] + [_pct(r.pass_at[k]) if k in r.pass_at else "–"
                                                                for k in ks]
                              + [f"{d['mean_response_length']:.0f}", _pct(d["truncated_frac"])]
                              + ([f"{d['tool_calls_mean']:.2f}", f"{d['tool_errors_mean']:.2f}"] if tools else [])))
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write results.md, results.json and (if responses were kept) samples.jsonl into `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out / "results.md", "json": out / "results.json"}
        write_text_atomic(paths["markdown"], self.markdown())
        write_text_atomic(paths["json"], json.dumps(self.to_dict(), indent=2) + "\n")
        if any(r.responses for r in self.results):
            paths["samples"] = out / "samples.jsonl"
            write_text_atomic(paths["samples"], "".join(_sample_lines(self.results)))
        return paths


def _sample_lines(results: list[BenchmarkResult]):
    for r in results:
        for i, responses in enumerate(r.responses):
            yield json.dumps({"benchmark": r.benchmark, "setting": r.setting.name, "index": r.problem_index[i],
                              "ground_truth": r.ground_truth[i], "responses": responses,
                              "correct": r.correct[i].tolist()}) + "\n"


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
