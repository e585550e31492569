"""Atomic, resumable checkpoints and plain Hugging Face export (docs/distributed.md, "Resuming").

``step_N/`` holds DeepSpeed's ``zero/`` shards, ``client_state.pt`` (the trainer's state and every rank's RNG)
and ``meta.json``; ``latest`` names the newest complete one. A save writes ``.tmp-step_N`` and rank 0 renames
it after a barrier, so a killed run leaves ``latest`` on a complete checkpoint (leftovers go at the next save).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from stapo.run_dir import (CHECKPOINT_DIR, CLIENT_FILE, LATEST, MERGED_DIR, PREVIOUS_RUNS_DIR, RUN_ARTIFACTS,
                           TMP_PREFIX, checkpoint_name, complete_checkpoints, first_line, latest_checkpoint,
                           write_text_atomic)
from stapo.distributed.process_group import all_gather_object, barrier, get_rank, get_world_size
from stapo.distributed.lora import adapter_state, is_peft_model, plain_model
from stapo.distributed.rng_state import capture_rng_state, restore_rng_state
from stapo.sync.buckets import DEFAULT_BUCKET_BYTES, iter_weight_buckets
from stapo.trainer.resume import DS_TAG, CheckpointUnreadable


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, replacing an existing ``dst`` (a re-save of the same step)."""
    if dst.exists():
        old = dst.with_name(f"{TMP_PREFIX}old-{dst.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)


def _json_or_none(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return None


def archive_previous_run(output_dir: str | os.PathLike) -> Path | None:
    """Move an earlier run's files to ``output_dir/previous_runs/<UTC time>/`` (returned; None: nothing to
    move), so a fresh start never mixes two runs' metrics nor overwrites what the user trained. Rank 0 only."""
    output_dir = Path(output_dir)
    present = [output_dir / name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    archive, n = output_dir / PREVIOUS_RUNS_DIR / stamp, 1
    while archive.exists():
        archive, n = output_dir / PREVIOUS_RUNS_DIR / f"{stamp}-{n}", n + 1
    archive.mkdir(parents=True)
    for path in present:
        os.replace(path, archive / path.name)
    return archive


class CheckpointManager:
    """Saves/loads DeepSpeed training state atomically under ``output_dir/checkpoints``; collective.
    ``exclude_frozen`` (LoRA): only the trainable parameters are written (a resume rebuilds the base)."""

    def __init__(self, output_dir: str | os.PathLike, keep_last: int = 2, *, exclude_frozen: bool = False) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / CHECKPOINT_DIR
        self.keep_last = keep_last
        self.exclude_frozen = exclude_frozen

    def clean_stale(self) -> list[Path]:
        """Delete ``.tmp-*`` leftovers of killed saves (rank 0); returns what was removed."""
        if get_rank() != 0 or not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX)]
        for path in stale:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return stale

    def save(self, engine, step: int, client_state: dict[str, Any], *, protect: tuple[int, ...] = ()) -> Path:
        """Write checkpoint ``step_<step>``; returns its path once it is complete on all ranks. Pruning to
        ``keep_last`` spares the steps in ``protect`` (the healthy checkpoints a rollback may need)."""
        final = self.root / checkpoint_name(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if get_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self.clean_stale()
            tmp.mkdir()
        barrier()
        frozen = {"exclude_frozen_parameters": True} if self.exclude_frozen else {}  # DeepSpeed's default otherwise
        engine.save_checkpoint(str(tmp), tag=DS_TAG, client_state={}, save_latest=False, **frozen)
        rng_states = all_gather_object(capture_rng_state())  # [rank] -> state
        if get_rank() == 0:
            payload = {"step": step, "world_size": get_world_size(), "client_state": client_state,
                       "rng": rng_states}
            torch.save(payload, tmp / CLIENT_FILE)
            meta = {"step": step, "world_size": get_world_size(),
                    "client_state": _json_or_none(client_state)}
            write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=2, default=str))
        barrier()  # every rank's ZeRO shard is on disk
        if get_rank() == 0:
            _replace_dir(tmp, final)
            write_text_atomic(self.root / LATEST, final.name)
            self._prune(keep=final, protect={checkpoint_name(s) for s in protect})
        barrier()
        return final

    def _prune(self, keep: Path, protect: set[str] = frozenset()) -> None:
        done = complete_checkpoints(self.output_dir)
        for path in done[: max(0, len(done) - self.keep_last)]:
            if path != keep and path.name not in protect:
                shutil.rmtree(path)

    def load(self, engine, path: str | os.PathLike | None = None, *, restore_rng: bool = True) -> dict[str, Any]:
        """Restore module, optimizer and lr schedule (and this rank's RNG) from ``path`` (default: the latest);
        returns the client state."""
        path = Path(path) if path is not None else latest_checkpoint(self.output_dir)
        if path is None or not (path / CLIENT_FILE).is_file():
            raise FileNotFoundError(f"no complete checkpoint at {path or self.root}")
        payload = torch.load(path / CLIENT_FILE, weights_only=False, map_location="cpu")  # our own file
        if payload["world_size"] != get_world_size():
            raise RuntimeError(f"checkpoint {path} was saved with world size {payload['world_size']}, "
                               f"now {get_world_size()}: resume with the same number of ranks")
        partial = {"load_module_strict": False} if self.exclude_frozen else {}  # frozen base not in the file
        try:  # damage the preflight's checks (stapo.trainer.resume) cannot see: one message naming the path
            loaded, _ = engine.load_checkpoint(str(path), tag=DS_TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=True, **partial)
        except Exception as exc:
            raise CheckpointUnreadable(f"checkpoint {path} could not be loaded ({first_line(exc)}); nothing was "
                                       "deleted: trainer.resume=PATH picks an older checkpoint") from exc
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path / DS_TAG}")
        if restore_rng:
            restore_rng_state(payload["rng"][get_rank()])
        return payload["client_state"]


def export_hf(model, tokenizer, out_dir: str | os.PathLike,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """A plain HF model directory from the ZeRO-3 weights of ``model`` (engine or module; LoRA: merged).
    Collective: the ranks gather bucket by bucket, rank 0 writes a temp dir and renames it into place."""
    out_dir = Path(out_dir)
    module = plain_model(getattr(model, "module", model))  # LoRA: the transformers model inside
    is_main = get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for bucket in iter_weight_buckets(model, bucket_bytes, copy=False):
        if is_main:
            state.update({name: tensor.to("cpu", copy=True) for name, tensor in bucket})
    if is_main:
        _save_pretrained_atomic(module, state, tokenizer, out_dir)
    barrier()
    return out_dir


def _save_pretrained_atomic(module, state: dict, tokenizer, out_dir: Path) -> None:
    """``module.save_pretrained(state_dict=state)`` (+ the tokenizer) into a temp dir renamed into place."""
    tmp = out_dir.with_name(f"{TMP_PREFIX}{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    module.save_pretrained(tmp, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _replace_dir(tmp, out_dir)


def export_final(model, tokenizer, out_dir: str | os.PathLike, *, merged: bool = False) -> Path:
    """``final/``: the full HF model, or for a LoRA policy the adapter (PEFT-loadable) and, with
    ``merged``, the merged model in ``final/merged`` (plain ``from_pretrained``). Collective."""
    if not is_peft_model(model):
        return export_hf(model, tokenizer, out_dir)
    out_dir = Path(out_dir)
    state = adapter_state(model)  # the adapter: loadable with PeftModel.from_pretrained(base, out_dir)
    if get_rank() == 0:
        _save_pretrained_atomic(getattr(model, "module", model), state, tokenizer, out_dir)
    barrier()
    if merged:
        export_hf(model, tokenizer, out_dir / MERGED_DIR)
    return out_dir
