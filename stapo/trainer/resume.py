"""Which checkpoint ``trainer.resume`` continues, checked before any weights load (docs/distributed.md,
"Resuming"): ``auto`` skips unreadable ones and refuses another experiment's. The checks read the client
state and the zip directories of DeepSpeed's files (where a truncated file loses its table), not the tensors.
"""

from __future__ import annotations

import logging
import re
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.config.experiment import ConfigChanges, config_changes
from stapo.run_dir import CHECKPOINT_DIR, CLIENT_FILE, LATEST, complete_checkpoints, first_line, step_of

__all__ = ["CheckpointUnreadable", "ExperimentChanged", "ResumeChoice", "checkpoint_problem", "choose_checkpoint",
           "log_changes", "resume_changes"]

log = logging.getLogger("stapo.trainer")

DS_TAG = "zero"  # the DeepSpeed tag directory inside a checkpoint (its files: stapo.trainer.checkpoint)
_RANK_FILE = re.compile(r"rank_(\d+)_")  # zero_pp_rank_<r>_mp_rank_00_optim_states.pt: one per rank


class CheckpointUnreadable(ValueError):
    """The checkpoint the user named, or every checkpoint of the run, cannot be loaded."""


class ExperimentChanged(ValueError):
    """``trainer.resume=auto`` found a checkpoint of another experiment in ``output_dir``."""


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint to continue (None: a fresh start) and the newer ones skipped, with why."""

    path: Path | None
    skipped: tuple[tuple[Path, str], ...] = ()


def checkpoint_problem(path: Path, world_size: int) -> str | None:
    """Why checkpoint ``path`` cannot be resumed on ``world_size`` ranks, or None when it looks intact."""
    client = path / CLIENT_FILE
    if not client.is_file():
        return f"{CLIENT_FILE} is missing (the save did not finish)"
    try:
        saved = int(torch.load(client, weights_only=False, map_location="cpu")["world_size"])  # our own file
    except Exception as exc:  # a damaged file raises whatever the unpickler met
        return f"{CLIENT_FILE} cannot be read ({first_line(exc)})"
    if saved != world_size:
        return f"saved with {saved} rank(s), this run has {world_size}: resume with the same number of ranks"
    files = sorted((path / DS_TAG).glob("*.pt"))
    if not any(f.name.endswith("model_states.pt") for f in files):
        return f"{DS_TAG}/ holds no model states file"
    shards: dict[str, set[int]] = defaultdict(set)
    for file in files:
        match = _RANK_FILE.search(file.name)
        if match:
            shards[_RANK_FILE.sub("rank_N_", file.name, count=1)].add(int(match.group(1)))
    for kind, ranks in sorted(shards.items()):
        missing = sorted(set(range(saved)) - ranks)
        if missing:
            return f"{DS_TAG}/{kind}: the shard(s) of rank(s) {missing} are missing"
    for file in files:
        problem = _zip_problem(file)
        if problem is not None:
            return f"{DS_TAG}/{file.name} {problem}"
    return None


def _zip_problem(file: Path) -> str | None:
    """A torch.save zip cut off: no table of contents at its end, or entries that run past it."""
    try:
        with zipfile.ZipFile(file) as archive:
            size = file.stat().st_size
            if any(info.header_offset + info.compress_size > size for info in archive.infolist()):
                return "is truncated (entries run past the end of the file)"
    except (zipfile.BadZipFile, OSError) as exc:
        return f"is truncated or damaged ({first_line(exc)})"
    return None


def choose_checkpoint(output_dir: str | Path, how: str, world_size: int) -> ResumeChoice:
    """``trainer.resume`` (``auto`` / ``force`` / ``never`` / a path) -> the checkpoint to load: ``latest``, else
    the newest intact one; CheckpointUnreadable when a named checkpoint, or every one, cannot be resumed."""
    if how == "never":
        return ResumeChoice(None)
    if how not in ("auto", "force"):
        path = Path(how)
        if not path.exists():
            raise FileNotFoundError(f"trainer.resume: checkpoint {how} does not exist")
        problem = checkpoint_problem(path, world_size)
        if problem is not None:
            raise CheckpointUnreadable(f"trainer.resume: checkpoint {path} cannot be resumed: {problem}")
        return ResumeChoice(path)
    skipped = []
    for path in _candidates(Path(output_dir)):
        problem = checkpoint_problem(path, world_size)
        if problem is None:
            return ResumeChoice(path, tuple(skipped))
        skipped.append((path, problem))
    if skipped:
        listed = "; ".join(f"{p}: {why}" for p, why in skipped)
        raise CheckpointUnreadable(
            f"trainer.resume={how}: no checkpoint under {Path(output_dir) / CHECKPOINT_DIR} can be resumed ({listed}). "
            "Nothing was deleted; trainer.resume=never starts over (the run's files move to previous_runs/)")
    return ResumeChoice(None)


def _candidates(output_dir: Path) -> list[Path]:
    """Complete checkpoints newest first, the one ``latest`` names leading."""
    done = complete_checkpoints(output_dir)[::-1]
    pointer = output_dir / CHECKPOINT_DIR / LATEST
    if pointer.is_file():
        named = output_dir / CHECKPOINT_DIR / pointer.read_text(encoding="utf-8").strip()
        if named in done:
            done = [named] + [p for p in done if p != named]
    return done


def warn_skipped(choice: ResumeChoice) -> None:
    """One warning per skipped checkpoint: its path, why, and the one used instead."""
    for path, why in choice.skipped:
        log.warning("checkpoint %s cannot be resumed (%s): skipped, resuming from %s instead (nothing was "
                    "deleted)", path, why, choice.path)


def resume_changes(path: Path, now: dict, how: str, output_dir: str | Path) -> ConfigChanges:
    """How this run's config (``now``, a ``to_dict()``) differs from the one checkpoint ``path`` was trained
    with; ExperimentChanged under ``trainer.resume=auto`` when the experiment itself differs."""
    payload = torch.load(path / CLIENT_FILE, weights_only=False, map_location="cpu")  # our own file
    saved = (payload.get("client_state") or {}).get("config")
    if saved is None:  # written before checkpoints recorded their config: nothing to compare with
        return ConfigChanges((), ())
    changes = config_changes(saved, now, step_of(path))
    if changes.experiment and how == "auto":
        key, _, value = changes.experiment[0].partition(": ")
        suffix = re.sub(r"[^\w.-]+", "", f"{key.rsplit('.', 1)[-1]}-{value.rpartition(' -> ')[2]}")[:40]
        raise ExperimentChanged(
            f"trainer.output_dir {output_dir} holds {path.name} of another experiment ({'; '.join(changes.experiment)}):"
            f" resuming would continue it under these settings. Train into another directory "
            f"(trainer.output_dir={str(output_dir).rstrip('/')}-{suffix}) or continue it anyway (trainer.resume=force)")
    return changes


def log_changes(path: Path, changes: ConfigChanges, how: str) -> None:
    """A warning for a continued experiment that changed (``force`` or a named checkpoint), one info line
    for changed run settings."""
    if changes.experiment:
        log.warning("trainer.resume=%s: continuing %s, trained as another experiment: %s", how, path,
                    "; ".join(changes.experiment))
    if changes.settings:
        log.info("resuming %s with changed run settings: %s", path, "; ".join(changes.settings))
