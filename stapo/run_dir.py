"""The run directory's format: artifact names, the metrics reader, record and checkpoint paths.

A training run writes everything into ``trainer.output_dir``::

    config.yaml          the resolved config            metrics.jsonl   one JSON line per step
    samples.jsonl        logged sample completions      tensorboard/    TensorBoard scalars
    token_records/       inspector records (step_XXXXXX.pt, step_XXXXXX_mbK.pt)
    checkpoints/         step_N/ checkpoints + ``latest``   final/   the exported HF model
    curves.png           training curves                inspect/        ``stapo inspect`` output
    health.png           ``stapo health``'s timeline

The bottom floor (standard library only): readers of these files import this, never ``stapo.trainer``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
RECORDS_DIR = "token_records"
CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
MERGED_DIR = "merged"  # final/merged: a LoRA run's merged model (final/ itself holds the adapter)
CURVES_FILE = "curves.png"
HEALTH_FILE = "health.png"  # `stapo health`'s figure
INSPECT_DIR = "inspect"
PREVIOUS_RUNS_DIR = "previous_runs"
#: ``.shared-probe-<token>``: written by global rank 0 at start and looked for by every rank, then deleted
#: (stapo.distributed.shared_dir: output_dir must be one directory all nodes see).
SHARED_PROBE_PREFIX = ".shared-probe-"
#: What a write in progress is called beside its final name; a killed checkpoint save's leftovers go at the next.
TMP_PREFIX = ".tmp-"

#: What a training run writes into its output_dir; a fresh start moves an earlier run's copies aside.
RUN_ARTIFACTS = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR, RECORDS_DIR, CHECKPOINT_DIR,
                 FINAL_DIR, CURVES_FILE, INSPECT_DIR, HEALTH_FILE)

# Inside CHECKPOINT_DIR: ``step_N/`` directories, complete once CLIENT_FILE is in them, and a
# ``latest`` text file naming the newest complete one.
LATEST = "latest"
CLIENT_FILE = "client_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RECORD_NAME = re.compile(r"^step_(\d+)(?:_mb(\d+))?\.pt$")

logger = logging.getLogger(__name__)

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def written_artifacts(output_dir: str | Path) -> list[str]:
    """The entries of :data:`RUN_ARTIFACTS` present in ``output_dir`` (directories with a ``/``): what the
    end-of-run summary lists, so a switched-off sink (``logging.plot``, ...) is not named."""
    root = Path(output_dir)
    return [name + "/" if (root / name).is_dir() else name
            for name in RUN_ARTIFACTS if (root / name).exists()]


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``TMP_PREFIX`` + its name, fsync, then rename it over ``path``: a reader sees the old
    file or the new one, never half of one."""
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name if it has none): what a one-line error quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def restore_nonfinite(record: dict[str, Any]) -> dict[str, Any]:
    """The strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (how metrics.jsonl stores them) as floats."""
    return {k: (NONFINITE[v] if isinstance(v, str) and v in NONFINITE else v)
            for k, v in record.items()}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (or of a run dir's), non-finite strings restored to floats.

    A truncated last line (the run was killed mid-write) is skipped with a warning; a corrupt line elsewhere raises.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(restore_nonfinite(json.loads(line)))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:  # no trailing newline: the line being written when killed
                logger.warning("%s: ignoring truncated last line %d", path, i + 1)
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({err})") from err
    return rows


def token_record_path(run_dir: str | Path, step: int, minibatch: int = 0) -> Path:
    """``RUN_DIR/token_records/step_XXXXXX.pt`` (``_mbK`` suffix for mini-batch K > 0)."""
    suffix = f"_mb{minibatch}" if minibatch else ""
    return Path(run_dir) / RECORDS_DIR / f"step_{step:06d}{suffix}.pt"


def token_record_paths(run_dir: str | Path) -> list[Path]:
    """The run's token-record files ordered by (step, mini-batch); other files are ignored."""
    folder = Path(run_dir) / RECORDS_DIR
    found = sorted((int(m[1]), int(m[2] or 0), p) for p in folder.glob("step_*.pt")
                   if (m := _RECORD_NAME.match(p.name)))
    return [p for *_, p in found]


def checkpoint_name(step: int) -> str:
    """``step_N``: the directory name of the checkpoint taken after iteration ``step``."""
    return f"step_{step}"


def step_of(path: str | os.PathLike) -> int:
    """The step number of a ``step_N`` checkpoint directory."""
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory named step_<N>")
    return int(match.group(1))


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``step_N`` directories that finished saving, oldest first."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / CLIENT_FILE).is_file()]
    return sorted(done, key=step_of)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else ``None``."""
    root = Path(output_dir) / CHECKPOINT_DIR
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        if (named / CLIENT_FILE).is_file():
            return named
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None
