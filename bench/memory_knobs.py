"""Benchmark: what activation checkpointing and compiled decoder layers cost and save, against both off.

``model.gradient_checkpointing`` (each decoder layer recomputed in backward) and ``model.compile_layers``
(each decoder layer through ``torch.compile``), alone and together, against neither: the trainer's stats pass
and update (bench/gpu_step.py's ``run_phases``: the project's DeepSpeed engine at ZeRO-1, packed rows, token
budgets) on a Qwen3-shaped policy and a synthetic RL batch. Each configuration runs in its own process (fresh
compile caches, its own memory peak): the stats pass and updates once as a warm-up (which compiles), then
timed. Reports seconds per phase and their ratios to ``off``, the memory the timed phases added at their
peak (GPU: ``max_memory_allocated``; CPU: the process's peak resident memory, reset after the warm-up, with
glibc returning every freed block above 64 KiB to the system so the peak follows the live tensors), and the
largest difference of the stats pass's logprobs from ``off`` (exactness: both knobs change float rounding only).

    python bench/memory_knobs.py                  # 2 layers of the Qwen3-0.6B shape (width 1,024), 2k-token budgets
    python bench/memory_knobs.py --smoke          # 2 layers, width 64: seconds plus the compilations
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_step import SHAPES, Layout, build_engine, run_phases, synthetic_batch

KNOBS = {"off": {}, "checkpointing": {"gradient_checkpointing": True}, "compile": {"compile_layers": True},
         "checkpointing+compile": {"gradient_checkpointing": True, "compile_layers": True}}
# policy shape overrides, batch: sequences, G, prompt range, max response, mini-batches, token budget
FULL = dict(shape=dict(SHAPES["qwen3_0p6b"], num_hidden_layers=2, vocab_size=384),
            work=dict(sequences=16, group=8, prompt=(48, 64), response=512, minibatches=2, budget=2048))
SMOKE = dict(shape=dict(SHAPES["smoke"], vocab_size=384),
             work=dict(sequences=16, group=8, prompt=(6, 8), response=24, minibatches=2, budget=64))


def _resident(field: str) -> int:
    """This process's VmRSS or VmHWM (peak) in bytes (Linux)."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def measure(knob: str, setup: dict, logprobs_out: Path) -> dict:
    """One configuration, in this process: warm-up, then the timed phases and their added peak memory."""
    from transformers import Qwen3Config

    from stapo.distributed.process_group import init_distributed

    init_distributed()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    work = setup["work"]
    config = Qwen3Config(tie_word_embeddings=True, attn_implementation="sdpa", **setup["shape"])
    seqs = synthetic_batch(work["sequences"], work["group"], work["prompt"], work["response"], config.vocab_size)
    rows = work["sequences"] // work["minibatches"]
    layout = Layout("packed", True, rows, work["budget"])
    engine = build_engine(config, 1, rows, rows, bf16=cuda, **KNOBS[knob])
    start = time.perf_counter()
    run_phases(engine, seqs, layout, work["minibatches"], "sdpa", sync)  # the same passes once: compiles, if asked
    warm_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident memory (Linux >= 4.0)
        base = _resident("VmRSS")
    times, logprobs = run_phases(engine, seqs, layout, work["minibatches"], "sdpa", sync)
    added = (torch.cuda.max_memory_allocated() if cuda else _resident("VmHWM")) - base
    torch.save(logprobs.float().cpu(), logprobs_out)
    return {"knob": knob, "warmup_s": warm_s, **times, "added_peak_mib": added / 2**20,
            "device": torch.cuda.get_device_name() if cuda else "CPU"}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2 layers, width 64 (seconds plus the compilations)")
    ap.add_argument("--knobs", default=",".join(KNOBS), help="configurations to run, from: " + ", ".join(KNOBS))
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--one", choices=list(KNOBS), help=argparse.SUPPRESS)  # a child: one configuration
    ap.add_argument("--logprobs", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    setup = SMOKE if args.smoke else FULL
    if args.one:
        print("ROW " + json.dumps(measure(args.one, setup, args.logprobs)))
        return []
    rows, logprobs = [], {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the resident set (module doc)
    with tempfile.TemporaryDirectory() as tmp:
        for knob in args.knobs.split(","):
            path = Path(tmp) / f"{knob}.pt"
            cmd = [sys.executable, __file__, "--one", knob, "--logprobs", str(path)] + (["--smoke"] if args.smoke else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"memory_knobs: {knob} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW "))))
            logprobs[knob] = torch.load(path)
    base = next((r for r in rows if r["knob"] == "off"), None)
    for r in rows:
        r["logprob_max_diff"] = float((logprobs[r["knob"]] - logprobs["off"]).abs().max()) if base else None
    print(report(rows, setup))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


def report(rows: list[dict], setup: dict) -> str:
    base = next((r for r in rows if r["knob"] == "off"), None)
    s, w = setup["shape"], setup["work"]
    lines = [f"Memory knobs, device {rows[0]['device']}: {s['num_hidden_layers']} layers, width {s['hidden_size']}, "
             f"{w['sequences']} sequences (responses <= {w['response']}), packed, {w['budget']}-token budgets, ZeRO-1", "",
             "| configuration | warm-up s | stats s | × off | update s | × off | added peak MiB | × off "
             "| logprob max diff vs off |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = {k: (r[k] / base[k] if base and base[k] else float("nan"))
                 for k in ("stats_s", "update_s", "added_peak_mib")}
        lines.append(f"| {r['knob']} | {r['warmup_s']:.1f} | {r['stats_s']:.2f} | {ratio['stats_s']:.2f} | {r['update_s']:.2f} "
                     f"| {ratio['update_s']:.2f} | {r['added_peak_mib']:,.0f} | {ratio['added_peak_mib']:.2f} "
                     f"| {r['logprob_max_diff']:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
