"""``data.source`` / ``data.eval_source`` checked before anything heavy starts (``plan_run``); a hub name is
looked up in the local caches only, like ``model.path`` (stapo.trainer.model_source).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stapo.config import STAPOConfig
from stapo.data import DataError, looks_like_file, resolve_fields, row_field, scan_data_file
from stapo.trainer.model_source import not_cached

__all__ = ["DataSource", "check_data"]

BUILTIN, FILE, DIRECTORY, CACHED, HUB = "builtin", "file", "directory", "cached", "hub"
_HEAD = 8  # rows whose columns are checked


@dataclass(frozen=True)
class DataSource:
    """One configured dataset: its setting, value, kind, rows (files) and why it cannot load here, or None."""

    setting: str
    source: str
    kind: str
    rows: int | None = None
    problem: str | None = None

    def describe(self) -> str:
        return {BUILTIN: "the built-in arithmetic task",
                FILE: f"a local file, {self.rows:,} rows" if self.rows is not None else "a local file",
                DIRECTORY: "a local dataset directory",
                CACHED: "a Hugging Face hub dataset found in the local cache",
                HUB: "a Hugging Face hub dataset, downloaded at start"}[self.kind]


def check_data(cfg: STAPOConfig) -> list[DataSource]:
    """``data.source`` and (when set) ``data.eval_source``; DataError on the first error in either."""
    from stapo.trainer.components import BUILTIN_DATA

    d = cfg.data
    found = [_check(cfg, "data.source", d.source, BUILTIN_DATA)]
    if d.eval_source is not None:
        found.append(_check(cfg, "data.eval_source", d.eval_source, BUILTIN_DATA))
    return found


def _check(cfg: STAPOConfig, setting: str, source: str, builtin: str) -> DataSource:
    if source == builtin:
        return DataSource(setting, source, BUILTIN)
    path = Path(source).expanduser()
    if path.is_dir():
        return DataSource(setting, source, DIRECTORY)
    if path.exists() or looks_like_file(source):
        try:
            scan = scan_data_file(path, head=_HEAD)
        except DataError as exc:
            raise DataError(f"{setting}: {exc}") from None
        _check_columns(cfg, setting, scan.path, scan.head)
        return DataSource(setting, source, FILE, rows=scan.rows)
    return _hub_dataset(setting, source, cfg)


def _check_columns(cfg: STAPOConfig, setting: str, path: Path, rows: list[dict]) -> None:
    d = cfg.data
    prompt, answer = resolve_fields(d.prompt_field, d.answer_field, d.preset)
    for i, row in enumerate(rows):
        for name, field in (("data.prompt_field", prompt), ("data.answer_field", answer)):
            try:
                row_field(row, field, i)
            except KeyError:
                where = f"column {field!r}" if "." not in field else f"field {field!r}"
                via = name if field == getattr(d, name.split(".")[1]) else f"{name} via data.preset={d.preset}"
                raise DataError(f"{setting} {path}: row {i} has no {where} ({via}); its columns: {sorted(row)}. "
                                f"Set {name}=<column> to read another column") from None


def _hub_dataset(setting: str, name: str, cfg: STAPOConfig) -> DataSource:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise DataError(f"{setting} {name!r}: no such file or directory, and not a hub dataset name "
                        "(org/name)") from None
    if _cached(name, Path(cfg.trainer.output_dir) / "cache" / "datasets"):
        return DataSource(setting, name, CACHED)
    fix = (f"set {setting} to a local .jsonl / .json / .parquet file, or download it once where the hub is "
           f"reachable (hf download {name} --repo-type dataset) and run with HF_HUB_OFFLINE=1 to use the cache")
    return DataSource(setting, name, HUB, problem=not_cached(f"{setting} {name!r}", "file", fix))


def _cached(name: str, datasets_cache: Path) -> bool:
    """In the hub cache (``datasets--org--name``) or in ``datasets``' own cache of this run's output_dir."""
    from huggingface_hub.constants import HF_HUB_CACHE

    hub = Path(HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "snapshots"
    own = datasets_cache / name.replace("/", "___")
    return any(folder.is_dir() and any(folder.iterdir()) for folder in (hub, own))
