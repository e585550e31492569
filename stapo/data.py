"""Prompt datasets for RL on verifiable math: rows -> chat-templated prompt token ids + answers (docs/rollout.md).

The paper's setup (STAPO §5.1: DAPO-Math-17K with a ``\\boxed{}`` instruction): docs/rollout.md, "Prompt data".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PAPER_INSTRUCTION", "PRESETS", "DataError", "DataFileScan", "DatasetPreset", "PromptDataset",
           "PromptExample", "PromptSampler", "format_problem", "load_prompt_dataset", "prompt_dataset_from_records",
           "render_chat", "resolve_fields", "row_field", "scan_data_file", "strip_dapo_instruction"]

logger = logging.getLogger("stapo.data")

PAPER_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
                "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def strip_dapo_instruction(text: str) -> str:
    """DAPO-Math-17K prompt content -> the bare problem (drops DAPO's "Answer:" prefix and suffix)."""
    text = text.strip()
    if text.startswith(_DAPO_PREFIX):
        text = text[len(_DAPO_PREFIX):]
    if text.endswith(_DAPO_SUFFIX):
        text = text[: -len(_DAPO_SUFFIX)]
    return text.strip()


def format_problem(problem: str, instruction: str | None) -> str:
    """User message content: the problem, a space, the instruction (the tiny warm start uses the same)."""
    return f"{problem} {instruction}" if instruction else problem


@dataclass(frozen=True)
class DatasetPreset:
    """Where a known dataset lives and how its rows map onto (problem, answer)."""

    hf_name: str
    prompt_field: str
    answer_field: str
    clean_problem: Callable[[str], str] = str.strip


PRESETS: dict[str, DatasetPreset] = {
    "dapo_math_17k": DatasetPreset("BytedTsinghua-SIA/DAPO-Math-17k", "prompt", "reward_model.ground_truth",
                                   strip_dapo_instruction),
}


@dataclass(frozen=True)
class PromptExample:
    """One prompt: `index` is the row in the source split (before filtering); `fields` holds the
    row's other columns (all but the prompt and answer columns), for user reward functions."""

    index: int
    problem: str
    prompt_text: str
    prompt_ids: list[int]
    ground_truth: str
    fields: dict = field(default_factory=dict)


@dataclass
class PromptDataset:
    """The loaded prompts plus how many were dropped for length."""

    examples: list[PromptExample]
    num_filtered: int = 0

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def __iter__(self) -> Iterator[PromptExample]:
        return iter(self.examples)

    def batch(self, indices: Sequence[int]) -> tuple[list[list[int]], list[str]]:
        """`(prompt_ids, ground_truths)` for `indices` (what the rollout engine and rewards take)."""
        picked = [self.examples[i] for i in indices]
        return [e.prompt_ids for e in picked], [e.ground_truth for e in picked]


def load_prompt_dataset(source: str | Path | None = None, *, split: str = "train", prompt_field: str = "prompt",
                        answer_field: str = "answer", preset: str | None = None, tokenizer,
                        instruction: str | None = PAPER_INSTRUCTION, max_prompt_length: int | None = None,
                        data_files: Any = None, cache_dir: str | Path | None = None,
                        tools: Sequence[dict] | None = None) -> PromptDataset:
    """Load a dataset (HF hub name, local dir, or .jsonl / .json / .parquet file) into prompts.

    Fields, presets and prompt rules: docs/rollout.md, "Prompt data"; `tools`: the schemas the chat template
    renders into each prompt (multi-turn episodes, docs/tir.md).
    """
    if source is None and preset is not None:
        source = _preset(preset).hf_name
    if source is None:
        raise ValueError("load_prompt_dataset needs a source (dataset name or file) or a preset")
    return prompt_dataset_from_records(
        _load_rows(source, split, data_files, cache_dir), prompt_field=prompt_field, answer_field=answer_field,
        preset=preset, tokenizer=tokenizer, instruction=instruction, max_prompt_length=max_prompt_length,
        tools=tools)


def prompt_dataset_from_records(records: Iterable[dict], *, prompt_field: str = "prompt",
                                answer_field: str = "answer", preset: str | None = None, tokenizer,
                                instruction: str | None = PAPER_INSTRUCTION,
                                max_prompt_length: int | None = None,
                                tools: Sequence[dict] | None = None) -> PromptDataset:
    """Rows already in memory (dicts, or an HF `datasets.Dataset`) -> prompts; same rules as
    `load_prompt_dataset` (field mapping, preset cleaning, instruction, chat template, filter)."""
    prompt_field, answer_field = resolve_fields(prompt_field, answer_field, preset)
    clean = _preset(preset).clean_problem if preset is not None else str.strip
    messages, problems, answers, extras = [], [], [], []
    used = {prompt_field.split(".")[0], answer_field.split(".")[0]}  # top-level columns of the mapping
    for i, row in enumerate(records):
        chat, problem = _prompt_messages(row_field(row, prompt_field, i), i, prompt_field, clean)
        chat[-1] = {**chat[-1], "content": format_problem(problem, instruction)}
        answer = row_field(row, answer_field, i)
        if answer is None or not str(answer).strip():
            raise ValueError(f"row {i}: empty answer in field {answer_field!r}")
        messages.append(chat)
        problems.append(problem)
        answers.append(str(answer).strip())
        extras.append({k: v for k, v in row.items() if k not in used})
    texts = [render_chat(tokenizer, m, tools) for m in messages]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    examples = [PromptExample(i, problems[i], texts[i], list(ids[i]), answers[i], extras[i])
                for i in range(len(texts)) if max_prompt_length is None or len(ids[i]) <= max_prompt_length]
    dropped = len(texts) - len(examples)
    if max_prompt_length is not None:
        logger.info("filtered %d of %d prompts longer than %d tokens", dropped, len(texts), max_prompt_length)
    if texts and not examples:
        raise ValueError(f"all {len(texts)} prompts are longer than max_prompt_length={max_prompt_length}")
    return PromptDataset(examples, num_filtered=dropped)


def resolve_fields(prompt_field: str, answer_field: str, preset: str | None) -> tuple[str, str]:
    """The (prompt, answer) columns actually read: a preset's mapping unless the caller changed a default."""
    if preset is None:
        return prompt_field, answer_field
    p = _preset(preset)
    return (p.prompt_field if prompt_field == "prompt" else prompt_field,
            p.answer_field if answer_field == "answer" else answer_field)


def _preset(name: str) -> DatasetPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown dataset preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]


def _load_rows(source: str | Path, split: str, data_files: Any, cache_dir: str | Path | None):
    import datasets

    path, cache = Path(source).expanduser(), (str(cache_dir) if cache_dir is not None else None)
    if path.is_file() or (looks_like_file(str(source)) and not path.is_dir()):
        scan_data_file(path, head=0)  # missing, empty, truncated: one message naming file and line
        return datasets.load_dataset(_FORMATS[path.suffix], data_files={split: str(path)}, split=split,
                                     cache_dir=cache)
    return datasets.load_dataset(str(source), split=split, data_files=data_files, cache_dir=cache)


class DataError(ValueError):
    """Data a run cannot use (missing, empty, unreadable, wrong columns); the message names the file
    and line, so ``stapo train`` prints it as one line before anything heavy starts."""


@dataclass(frozen=True)
class DataFileScan:
    """What :func:`scan_data_file` read: the row count and the first rows."""

    path: Path
    rows: int
    head: list[dict]


def looks_like_file(source: str) -> bool:
    """A source meant as a local file (a data file suffix, or a path like ``./x`` / ``/x`` / ``~/x``),
    not a hub dataset name: a missing one is "no such file", not a failed download."""
    return Path(source).suffix in _FORMATS or source.startswith(("/", "./", "../", "~"))


def scan_data_file(path: str | Path, head: int = 8) -> DataFileScan:
    """Read every row of a local ``.jsonl`` / ``.json`` / ``.parquet`` file, keep the first ``head``: a missing,
    empty, truncated or hand-edited file is a DataError naming its line here, not ``datasets``' error later."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path}: no such file" if not path.exists() else f"{path} is not a file")
    if path.suffix not in _FORMATS:
        raise DataError(f"unsupported data file {path}: use one of {sorted(_FORMATS)}")
    rows = _parquet_rows(path, head) if path.suffix == ".parquet" else _json_rows(path, head)
    if rows.rows == 0:
        raise DataError(f"{path}: the file has no rows (it is empty)")
    return rows


def _json_rows(path: Path, head: int) -> DataFileScan:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of row objects
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}, line {exc.lineno}: not valid JSON ({exc.msg}); is the file truncated?") from None
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            raise DataError(f"{path}: item {bad} of the array is a {type(rows[bad]).__name__}, not a row object")
        return DataFileScan(path, len(rows), rows[:head])
    lines, count, first = text.splitlines(), 0, []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            cut = number == len(lines) and not text.endswith("\n")
            why = "the last line is cut off: the file looks truncated" if cut else "not valid JSON"
            raise DataError(f"{path}, line {number}: {why} ({exc.msg}, column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}, line {number}: a JSON {type(row).__name__}, not a row object {{...}}")
        count += 1
        if len(first) < head:
            first.append(row)
    return DataFileScan(path, count, first)


def _parquet_rows(path: Path, head: int) -> DataFileScan:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        first = next(file.iter_batches(batch_size=head), None) if head else None
    except Exception as exc:  # pyarrow raises several types for a damaged file; all mean the same here
        raise DataError(f"{path}: not a readable Parquet file ({str(exc).strip() or type(exc).__name__})") from None
    return DataFileScan(path, file.metadata.num_rows, first.to_pylist() if first is not None else [])


def row_field(row: dict, dotted: str, i: int) -> Any:
    """``row[a][b]`` for ``dotted="a.b"``; KeyError naming row ``i``, the missing key and the columns."""
    value: Any = row
    for depth, key in enumerate(dotted.split(".")):
        if not isinstance(value, dict) or key not in value:
            where = f"column {dotted!r}" if depth == 0 else f"key {key!r} of {dotted!r}"
            have = list(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"row {i}: missing {where}; available: {have}")
        value = value[key]
    return value


def _prompt_messages(value: Any, i: int, field: str, clean: Callable[[str], str]) -> tuple[list[dict], str]:
    """A prompt field -> (chat messages, problem text of the last user turn)."""
    if isinstance(value, str):
        chat = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        chat = [{"role": m.get("role", "user"), "content": m["content"]} for m in value]
        if chat[-1]["role"] != "user":
            raise ValueError(f"row {i}: the last message of {field!r} must be a user turn, got {chat[-1]['role']!r}")
    else:
        raise ValueError(f"row {i}: field {field!r} must be a string or a list of {{role, content}} messages, "
                         f"got {type(value).__name__}")
    problem = clean(str(chat[-1]["content"]))
    if not problem:
        raise ValueError(f"row {i}: empty prompt in field {field!r}")
    return chat, problem


def render_chat(tokenizer, messages: list[dict], tools: Sequence[dict] | None = None) -> str:
    """``messages`` in the tokenizer's chat template, up to the assistant's turn: THE prompt text."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template before loading prompts")
    return tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=True)


def balanced_shares(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Positions ``0..n-1`` of a batch dealt to ``world_size`` ranks, ``n / world_size`` each, with close total
    ``costs``: LPT with equal counts. Ties go to the lower position and rank, so every rank computes the same deal.
    """
    n = len(costs)
    if world_size < 1 or n % world_size:
        raise ValueError(f"balanced_shares: {n} prompts cannot be dealt evenly to {world_size} ranks")
    room, load = [n // world_size] * world_size, [0.0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        rank = min((r for r in range(world_size) if room[r]), key=lambda r: (load[r], r))
        shares[rank].append(i)
        room[rank] -= 1
        load[rank] += costs[i]
    return [sorted(share) for share in shares]


class PromptSampler:
    """Deterministic prompt batches: each epoch is a permutation drawn from (seed, epoch), so a run resumed from
    `state_dict()` continues with exactly the same data order (docs/distributed.md, "Resuming")."""

    def __init__(self, num_examples: int, batch_size: int, seed: int, drop_last: bool = True) -> None:
        if num_examples < 1 or batch_size < 1:
            raise ValueError(f"num_examples and batch_size must be >= 1, got {num_examples}, {batch_size}")
        if drop_last and batch_size > num_examples:
            raise ValueError(f"batch_size {batch_size} > num_examples {num_examples}: every batch would be dropped")
        self.num_examples, self.batch_size, self.seed, self.drop_last = num_examples, batch_size, seed, drop_last
        self.epoch, self.position = 0, 0  # position: examples of this epoch already served

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of example indices used in `epoch`."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def next_batch(self) -> list[int]:
        end = self.position + self.batch_size
        if end > self.num_examples and (self.drop_last or self.position >= self.num_examples):
            self.epoch, self.position = self.epoch + 1, 0
            end = self.batch_size
        batch = self.epoch_order(self.epoch)[self.position: end].tolist()
        self.position = min(end, self.num_examples)
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_examples": self.num_examples, "batch_size": self.batch_size, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_examples", "batch_size", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"PromptSampler.load_state_dict: saved {key}={state[key]!r} differs from "
                                 f"{getattr(self, key)!r}; the data order would not continue")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
