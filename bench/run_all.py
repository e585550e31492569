"""Regenerate every figure in docs/benchmarks.md.

Each benchmark runs as its own process; its Markdown output replaces the block between
``<!-- BEGIN name -->`` and ``<!-- END name -->`` in docs/benchmarks.md, so no figure on that page
exists without the command that produced it. Full logs go to bench/results/ (git-ignored).

    python bench/run_all.py                      # everything (about an hour on 2 CPU cores)
    python bench/run_all.py token_stats vs_trl   # a subset
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"

BENCHMARKS: dict[str, list[str]] = {
    "token_stats": ["bench/token_stats.py"],
    "verifier_speed": ["bench/verifier_speed.py"],
    "verifier_conformance": ["bench/verifier_conformance.py"],
    "weight_sync": ["bench/weight_sync.py", "--interleave"],
    "weight_sync_delta": ["bench/weight_sync_delta.py"],
    "zero_tuning": ["bench/zero_tuning.py"],
    "lora_memory": ["bench/lora_memory.py"],
    "memory_knobs": ["bench/memory_knobs.py"],
    "vs_trl": ["bench/vs_trl.py"],
    "ablation": ["bench/ablation.py", "--seeds", "0"],
}


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def replace_block(page: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
    if not pattern.search(page):
        raise SystemExit(f"docs/benchmarks.md has no <!-- BEGIN {name} --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"subset of: {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(BENCHMARKS):
        cmd = [sys.executable, *BENCHMARKS[name]]
        print(f"[run_all] {name}: {' '.join(BENCHMARKS[name])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (results / f"{name}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
        if proc.returncode != 0:
            print(f"[run_all] {name} failed (exit {proc.returncode}); see bench/results/{name}.log")
            continue
        stamp = (f"_`python {' '.join(BENCHMARKS[name])}` — {time.strftime('%Y-%m-%d')}, {machine()}, "
                 f"{time.perf_counter() - start:.0f} s._\n\n")
        PAGE.write_text(replace_block(PAGE.read_text(encoding="utf-8"), name, stamp + proc.stdout),
                        encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
