"""Benchmark presets and decoding settings of the STAPO evaluation protocol (paper §5.1, App. D).

Six math benchmarks, N per problem and two decoding settings as docs/evaluation.md lists them; any local
.jsonl / .json / .parquet file works too (`local_benchmark`, also how to evaluate offline). Prompts are
rendered exactly like training prompts (`stapo.data.load_prompt_dataset`).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from stapo.data import PAPER_INSTRUCTION, PromptDataset, load_prompt_dataset, looks_like_file
from stapo.run_dir import first_line

logger = logging.getLogger("stapo.evaluation")

__all__ = ["BENCHMARKS", "PAPER_SETTINGS", "SETTING_GROUPS", "BenchmarkPreset", "DecodingSetting",
           "get_benchmark", "load_benchmark", "local_benchmark"]

#: Samples per problem for a local file when neither the preset nor --samples says otherwise.
DEFAULT_LOCAL_SAMPLES = 4


@dataclass(frozen=True)
class DecodingSetting:
    """One sampling configuration of the evaluation (paper Table 2: two per benchmark)."""

    name: str
    temperature: float
    top_p: float

    @property
    def label(self) -> str:
        return f"T={self.temperature:g}, top-p={self.top_p:g}"


#: Training-aligned (T=1.0, top-p=1.0) and JustRL (T=0.7, top-p=0.9) settings, paper §5.1.
PAPER_SETTINGS: tuple[DecodingSetting, ...] = (DecodingSetting("train", 1.0, 1.0),
                                               DecodingSetting("justrl", 0.7, 0.9))
#: Greedy decoding (T=0): what a training run's own evaluation uses (`trainer.eval_every`); one sample is enough.
GREEDY = DecodingSetting("greedy", 0.0, 1.0)
#: `--settings` choices.
SETTING_GROUPS: dict[str, tuple[DecodingSetting, ...]] = {
    "paper": PAPER_SETTINGS, "train": PAPER_SETTINGS[:1], "justrl": PAPER_SETTINGS[1:], "greedy": (GREEDY,)}


@dataclass(frozen=True)
class BenchmarkPreset:
    """Where a benchmark lives (``hf_name``: a hub dataset, or a local .jsonl / .json / .parquet path) and how
    its rows map onto (problem, answer): dotted ``*_field`` paths, N (``num_samples``, paper §5.1), the hub
    ``data_files`` to read, and ``list_answer`` for a list column (OlympiadBench) joined with ", "."""

    name: str
    hf_name: str
    split: str
    prompt_field: str
    answer_field: str
    num_samples: int
    data_files: dict[str, list[str]] | None = None
    list_answer: bool = False

    @property
    def is_local(self) -> bool:
        return looks_like_file(self.hf_name)


BENCHMARKS: dict[str, BenchmarkPreset] = {p.name: p for p in (
    BenchmarkPreset("aime24", "HuggingFaceH4/aime_2024", "train", "problem", "answer", 32),
    BenchmarkPreset("aime25", "opencompass/AIME2025", "test", "question", "answer", 32,
                    data_files={"test": ["aime2025-I.jsonl", "aime2025-II.jsonl"]}),
    BenchmarkPreset("amc23", "math-ai/amc23", "test", "question", "answer", 32),
    BenchmarkPreset("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer", 4),
    BenchmarkPreset("minerva", "math-ai/minervamath", "test", "question", "answer", 4),
    BenchmarkPreset("olympiadbench", "math-ai/olympiadbench", "test", "question", "final_answer", 4,
                    list_answer=True),
)}


def get_benchmark(name: str) -> BenchmarkPreset:
    """The preset called `name`; an unknown name raises ValueError listing the valid ones."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)} "
                         "(or a local file with --data FILE)")
    return BENCHMARKS[name]


def local_benchmark(path: str | Path, *, name: str | None = None, prompt_field: str | None = None,
                    answer_field: str | None = None, num_samples: int | None = None) -> BenchmarkPreset:
    """A benchmark read from a local file. With `name` of a preset, the file replaces that preset's
    hub dataset and keeps its fields and N (offline evaluation); otherwise fields default to
    `problem` / `answer` and N to 4."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data: no such file: {path}")
    if name in BENCHMARKS:
        preset = dataclasses.replace(BENCHMARKS[name], hf_name=str(path), data_files=None)
    else:
        preset = BenchmarkPreset(name or path.stem, str(path), "test", "problem", "answer", DEFAULT_LOCAL_SAMPLES)
    return dataclasses.replace(preset, prompt_field=prompt_field or preset.prompt_field,
                               answer_field=answer_field or preset.answer_field,
                               num_samples=num_samples or preset.num_samples)


def load_benchmark(preset: BenchmarkPreset, tokenizer, *, instruction: str | None = PAPER_INSTRUCTION,
                   cache_dir: str | Path | None = None, tools: list[dict] | None = None) -> PromptDataset:
    """Load a benchmark's prompts (strict: a missing file raises FileNotFoundError; an unreachable dataset, a
    missing field or an empty answer one ValueError line); ``tools``: the schemas the prompts offer."""
    if preset.is_local and not Path(preset.hf_name).is_file():
        raise FileNotFoundError(f"{preset.name}: no such data file: {preset.hf_name}")
    if not preset.is_local:
        logger.info("%s: loading %s (split %s) from the Hugging Face hub or its cache", preset.name,
                    preset.hf_name, preset.split)
    try:
        dataset = load_prompt_dataset(preset.hf_name, split=preset.split, prompt_field=preset.prompt_field,
                                      answer_field=preset.answer_field, tokenizer=tokenizer,
                                      instruction=instruction, data_files=preset.data_files,
                                      cache_dir=cache_dir, tools=tools)
    except KeyError as err:  # missing column / nested key, raised by stapo.data with the row
        raise ValueError(f"{preset.name} ({preset.hf_name}): {err.args[0]}") from None
    except ValueError as err:
        raise ValueError(f"{preset.name} ({preset.hf_name}): {err}") from None
    except Exception as err:  # network, hub, or file-format errors from `datasets`
        if preset.is_local:
            raise ValueError(f"{preset.name}: could not read {preset.hf_name}: {first_line(err)[:200]}") from None
        raise ValueError(f"could not load {preset.hf_name} (offline?): pass a local file with "
                         f"--data {preset.name}=FILE  [{type(err).__name__}: {first_line(err)[:200]}]") from None
    if not len(dataset):
        raise ValueError(f"{preset.name} ({preset.hf_name}): no problems in split {preset.split!r}")
    if preset.list_answer:
        dataset = PromptDataset([dataclasses.replace(e, ground_truth=_join_list_answer(e.ground_truth))
                                 for e in dataset], dataset.num_filtered)
    return dataset


def _join_list_answer(text: str) -> str:
    """`"['$3$', '$5$']"` (a list column stringified by the loader) -> `"3, 5"`."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v).strip().strip("$").strip() for v in value)
    return text
