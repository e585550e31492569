"""What the mask ablation and the stability study share: one tiny-recipe training run in a fresh process.

``train_command`` builds the ``python -m stapo.cli train`` command line of one (mask, seed) run with the
per-mask parameters both studies use; ``run_training`` runs it and raises with the tail of stderr when
it fails. ``SMOKE`` shrinks a run to a few seconds (used by the tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILTIN_MASKS = ("none", "stapo", "entropy_top", "prob_only", "high_entropy_low_prob")
#: Explicit mask params: ``none`` takes none, ``entropy_top`` (20-Entropy) keeps the top 20% entropy,
#: ``prob_only`` its own tau_p; for the other masks no override: ``stapo``, the recipe's mask, keeps the
#: recipe's {tau_p, entropy_quantile}, any other mask (switching ``mask.name`` drops the recipe's
#: params) gets its own defaults; user-registered masks get ``{}``, i.e. their defaults too.
MASK_PARAMS = {"none": "{}", "entropy_top": "{entropy_quantile: 0.8}", "prob_only": "{tau_p: 0.002}"}
SMOKE = ["trainer.total_steps=2", "tiny.warm_start_steps=10", "data.eval_size=8", "data.num_builtin_problems=64",
         "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.group_size=4",
         "rollout.max_response_length=16", "trainer.save_every=0", "trainer.export_hf=false",
         "inspect.record_every=0", "logging.tensorboard=false"]


class TrainingFailed(RuntimeError):
    """A training process exited non-zero; ``returncode`` < 0 means it was killed by that signal."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def mask_params(mask: str) -> str | None:
    """The ``mask.params`` override of ``mask``, or None to keep the recipe's."""
    return MASK_PARAMS.get(mask, None if mask in BUILTIN_MASKS else "{}")


def train_command(mask: str, seed: int, run_dir: Path, recipe: Path, *, imports: list[str] = (),
                  extra: list[str] = (), resume: str = "never") -> list[str]:
    """The command line of one run: ``mask`` with ``trainer.seed = tiny.seed = seed`` into ``run_dir``."""
    overrides = [f"mask.name={mask}", f"trainer.output_dir={run_dir}", f"trainer.seed={seed}",
                 f"tiny.seed={seed}", f"trainer.resume={resume}", "logging.progress=false", *extra]
    params = mask_params(mask)
    if params is not None:
        overrides.append(f"mask.params={params}")
    imported = [arg for path in imports for arg in ("--import", path)]
    return [sys.executable, "-m", "stapo.cli", "train", *imported, str(recipe), *overrides]


def run_training(cmd: list[str], what: str, log_path: Path | None = None) -> None:
    """Run one training command from the repository root; its output goes to ``log_path`` if given.

    Raises :class:`TrainingFailed` with the tail of the output when the process exits non-zero.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if log_path is None:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        tail = proc.stderr[-3000:]
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
    if proc.returncode != 0:
        raise TrainingFailed(f"{what} failed (exit {proc.returncode}):\n{tail}", proc.returncode)


def replace_block(doc: Path, begin: str, end: str, block: str) -> None:
    """Put ``block`` (which starts with ``begin`` and ends with ``end``) where ``begin ... end`` is in ``doc``
    (a new file holds only the block); the prose around it stays as written."""
    text = doc.read_text(encoding="utf-8") if doc.is_file() else f"{begin}\n{end}\n"
    if begin not in text or end not in text:
        raise ValueError(f"{doc}: no {begin} ... {end} block to replace")
    head, rest = text.split(begin, 1)
    doc.write_text(head + block + rest.split(end, 1)[1], encoding="utf-8")
