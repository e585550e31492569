"""bench/gpu_window.sh's runner: the GPU checks of one short window, each part under its own time budget.

GPU machines come rarely and for minutes, so one command does everything a window should prove, in an
order that puts the cheap and decisive parts first, and never loses the whole run to one slow part: each
part runs in its own process group under a budget (``--budget NAME=SECONDS``); a part that overruns is
stopped and reported as cut, with what it wrote so far (bench/gpu_step.py keeps its JSON after every
configuration, pytest's verbose log its finished tests), and the next part starts. The sum of the default
budgets is under 9 minutes. Everything lands in ``$OUT`` (default ``outputs/gpu_window``): ``window.md``
(one table, a row per part, then the bench tables), ``window.json`` and a log per part. stdlib only: the
runner must start before anything is installed. docs/gpu.md, "One GPU window", says how to read the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE_ENV = Path("/tmp/stapo-gpu/env.sh")  # what the offline bundle's installer writes
WINDOW_S = 540  # 9 minutes


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: int
    what: str
    command: str  # run with bash; {py} and {out} are filled in


TRAIN = ("-m stapo.cli train trainer.output_dir={out}/train rollout.engine=vllm model.dtype=bf16 trainer.zero_stage=3 "
         "trainer.total_steps=3 rollout.gpu_memory_utilization=0.3 trainer.train_batch_size=32 trainer.mini_batch_size=8 "
         "trainer.micro_batch_size=64 data.eval_size=64 trainer.eval_every=0 trainer.save_every=0 "
         "inspect.record_every=0 logging.log_samples_every=0 logging.tensorboard=false logging.plot=false "
         "logging.progress=false")
E2E = "tests/gpu/test_train_gpu.py::test_stapo_train_with_vllm_in_one_plain_process_learns_syncs_and_resumes"
STEP = "bench/gpu_step.py --layouts packed"
PARTS = (
    Part("install", 60, "the offline bundle's parts (.gpu-N/stash.sh, in order) unless /tmp/stapo-gpu/env.sh exists",
         "for d in $(ls -d .gpu-[0-9]*/ | sort -t- -k2 -n); do bash \"$d/stash.sh\" || exit 1; done"),
    Part("check", 20, "versions, the GPU, flash-attn/Triton, what model.attn_implementation=auto picks",
         "{py} bench/_gpu_window.py --check"),
    Part("step_0p6b", 130, "bench/gpu_step.py, Qwen3-0.6B shape, real vocabulary, packed, sdpa vs auto, ZeRO-1",
         "{py} " + STEP + " --attn sdpa,auto --zero 1 --shape qwen3_0p6b --json {out}/gpu_step_0p6b.json"),
    Part("step_1p7b", 100, "the same at the Qwen3-1.7B shape, auto attention, ZeRO-3 (what the larger recipes run)",
         "{py} " + STEP + " --attn auto --zero 3 --shape qwen3_1p7b --json {out}/gpu_step_1p7b.json"),
    Part("pytest_gpu", 60, "pytest -m gpu, the attention tests first, without the end-to-end training test "
         "(two trainings and a resume, ~6 min: part train runs its 3-step version)",
         "{py} -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_attention_gpu.py tests --deselect " + E2E),
    Part("train", 160, "stapo train, 3 steps, tiny model, colocated vLLM (sleep/wake), ZeRO-3, bf16",
         "{py} " + TRAIN),
)


def plan_lines(parts, budgets: dict[str, int]) -> list[str]:
    total = sum(budgets[p.name] for p in parts)
    lines = [f"GPU window: {len(parts)} parts, {total} s of budgets (a window is {WINDOW_S} s)"]
    lines += [f"  {p.name:<11} {budgets[p.name]:>4} s  {p.what}\n{'':<20}$ {p.command}" for p in parts]
    if total > WINDOW_S:
        lines.append(f"note: the budgets exceed the window's {WINDOW_S} s: the last parts get what is left, or nothing")
    return lines


def run_part(command: str, budget_s: float, log: Path, env_file: Path | None = BUNDLE_ENV) -> tuple[str, float]:
    """``(status, seconds)`` of ``command`` (bash, in its own process group, the bundle's env.sh sourced when it
    exists): ``ok``, ``failed (exit N)`` or ``cut at N s`` (SIGTERM to the group at the budget, SIGKILL 10 s later)."""
    prefix = f"source {shlex.quote(str(env_file))} && " if env_file is not None and env_file.exists() else ""
    start = time.monotonic()
    with log.open("w") as sink:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        proc = subprocess.Popen(["bash", "-c", prefix + command], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return f"cut at {budget_s:.0f} s", time.monotonic() - start
    return ("ok" if code == 0 else f"failed (exit {code})"), time.monotonic() - start


def check() -> dict:
    """This machine's stack (part ``check``): versions, the GPU, and ``auto``'s attention choice."""
    import importlib.metadata

    import torch

    from stapo.distributed.attention import choose_attention

    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for name in ("vllm", "deepspeed", "transformers", "flash-attn", "flash-attn-3", "triton"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["auto_attention"] = choose_attention("auto", dtype=torch.bfloat16)
    return out


def summarize_step(path: Path) -> tuple[str, str]:
    """``(result, table)`` of a bench/gpu_step.py JSON (possibly a cut run's, without derived columns)."""
    if not path.exists():
        return "no configuration finished", ""
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    from _gpu_step_report import report  # the bench's own table, also for a cut run's rows

    data = json.loads(path.read_text())
    table = report(data) if data["rows"] else ""  # derives step seconds, MFU, the head's shares per row
    cells = []
    for r in data["rows"]:
        name = f"{r['attn']} ZeRO-{r['zero']}"
        if "error" in r:
            cells.append(f"{name}: {r['error'][:40]}")
            continue
        speed = f"update MFU {r['mfu_update']:.1%}" if "mfu_update" in r else f"step {r['step_s']:.1f} s"
        cells.append(f"{name}: {speed}, head {r['head_share_update']:.0%} of the update, {r['peak_gib'] or 0:.0f} GiB")
    return "; ".join(cells) or "no configuration finished", table


def summarize_pytest(log: str) -> str:
    counts: dict[str, int] = {}
    failed = []
    for test, outcome in re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log, re.M):
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome in ("FAILED", "ERROR"):
            failed.append(test.rsplit("::", 1)[-1])
    text = ", ".join(f"{n} {k.lower()}" for k, n in counts.items()) or "no test finished"
    return text + (f" ({', '.join(failed)})" if failed else "")


def summarize_train(log: str, metrics: Path) -> str:
    steps = []
    if metrics.exists():
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    freed = [float(x) for x in re.findall(r"Sleep mode freed ([\d.]+) ?GiB", log)]
    wake = [float(x) for x in re.findall(r"took ([\d.]+) seconds to wake up", log)]
    parts = [f"{len(steps)} of 3 steps"]
    if steps:
        parts.append(f"{sum(s.get('time_step', 0) for s in steps) / len(steps):.1f} s a step")
        if "mismatch_logp_abs_mean" in steps[-1]:
            parts.append(f"mismatch {steps[-1]['mismatch_logp_abs_mean']:.3g}")
    if freed:
        parts.append(f"sleep frees up to {max(freed):.1f} GiB")
    if wake:
        parts.append(f"wake <= {max(wake):.2f} s")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bash bench/gpu_window.sh", description="the GPU checks of one short window")
    ap.add_argument("--plan", action="store_true", help="print the parts and their budgets, run nothing")
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)  # part `check`, in its own process
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS", help="change a part's budget")
    ap.add_argument("--skip", default="", help="parts to leave out, e.g. install,train")
    args = ap.parse_args(argv)
    if args.check:
        print(json.dumps(check()))
        return 0
    budgets = {p.name: p.budget_s for p in PARTS}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in budgets or not seconds.isdigit():
            ap.error(f"--budget {item}: expected PART=SECONDS with PART one of {', '.join(budgets)}")
        budgets[name] = int(seconds)
    parts = [p for p in PARTS if p.name not in args.skip.split(",")]
    out = Path(os.environ.get("OUT") or ROOT / "outputs" / "gpu_window").resolve()
    py = shlex.quote(sys.executable)
    parts = [Part(p.name, p.budget_s, p.what, p.command.format(py=py, out=shlex.quote(str(out)))) for p in parts]
    print("\n".join(plan_lines(parts, budgets)), flush=True)
    if args.plan:
        return 0
    return run_window(parts, budgets, out)


def run_window(parts, budgets: dict[str, int], out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    results, tables = [], []
    deadline = time.monotonic() + WINDOW_S  # no part starts, or runs on, past the window
    for part in parts:
        log = out / f"{part.name}.log"
        budget = min(budgets[part.name], deadline - time.monotonic())
        skip = None
        if part.name == "install" and (BUNDLE_ENV.exists() or not list(ROOT.glob(".gpu-[0-9]*"))):
            skip = f"{BUNDLE_ENV}: " + ("present" if BUNDLE_ENV.exists() else "no bundle here, this python's packages")
        elif budget < 1:
            skip = f"not started: the window's {WINDOW_S} s are spent"
        if skip:
            results.append({"part": part.name, "status": "skipped", "seconds": 0, "budget_s": budgets[part.name],
                            "result": skip})
            continue
        status, seconds = run_part(part.command, budget, log)
        text = log.read_text(errors="replace")
        result = last = text.strip().splitlines()[-1][:160] if text.strip() else ""
        if part.name == "check" and status == "ok":
            result = ", ".join(f"{k} {v}" for k, v in json.loads(text.strip().splitlines()[-1]).items())
        elif part.name.startswith("step_"):
            result, table = summarize_step(out / f"gpu_step_{part.name[5:]}.json")
            tables.append(f"### {part.name}\n\n{table}" if table else "")
        elif part.name == "pytest_gpu":
            result = summarize_pytest(text)
        elif part.name == "train":
            result = summarize_train(text, out / "train" / "metrics.jsonl")
        if status != "ok" and last and last not in result:  # why it stopped, from its own last line
            result = f"{result}; last line: {last}"
        results.append({"part": part.name, "status": status, "seconds": round(seconds, 1),
                        "budget_s": budgets[part.name], "result": result})
        print(f"{part.name}: {status} in {seconds:.0f} s: {result}", flush=True)
    lines = ["| part | status | s | budget s | result |", "|---|---|---:|---:|---|"]
    lines += [f"| {r['part']} | {r['status']} | {r['seconds']:.0f} | {r['budget_s']} | {r['result'].replace('|', '/')} |"
              for r in results]
    (out / "window.md").write_text("\n".join(lines) + "\n\n" + "\n\n".join(t for t in tables if t) + "\n")
    (out / "window.json").write_text(json.dumps({"parts": results}, indent=2))
    print("\n" + "\n".join(lines) + f"\n\nwritten: {out}/window.md, window.json and a log per part")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
