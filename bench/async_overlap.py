"""Benchmark: the same run colocated, on a rollout server in lock-step (k = 0), and asynchronous (k = 1),
with and without partial rollouts.

``stapo train`` runs of one tiny recipe (same model, data, seed, sizes), one trainer rank each:

* ``colocated``: the trainer's own vLLM engine (``rollout.engine=vllm``): generation, update and sync
  take turns on the same device;
* ``server k=0``: one vLLM server (``stapo serve``) generates, the trainer waits for it, trains, syncs;
* ``server k=1``: ``rollout.max_staleness=1``: the next batch is generated during the update;
* ``server k=1 partial`` (with ``--long-tail``): ``rollout.partial=true`` as well: the sync cuts the batch
  under way instead of waiting for its longest response, which goes on with the new weights.

``--long-tail`` gives each prompt's responses a heavy-tailed length (Pareto; ``bench/_long_tail.py``,
imported into every run: vLLM's ``ignore_eos`` and ``max_tokens`` per request) — long-reasoning RL, where
a few responses run many times the median — and runs lock-step, k = 1 and k = 1 + partial (no colocated
run). Its table adds the step rate, the server's idle fraction (the share of a step's samples of vLLM's
running-request gauge that found nothing running; ``bench/_server_busy.py``), the trainer's stats phase
(θ_old's no-grad pass and the mask statistics) and the rollout tokens per second.

Per step, from each run's metrics: the step time, the trainer's wait for its rollouts
(``time_rollout``) and its share of the step (the trainer's idle fraction in the server modes; in the
colocated mode the same device generates then), the generation time (``generation_s``), update and
sync times, the rows' staleness and the rollout–trainer mismatch. The summary table takes medians over the
steps after the first (start-up), but the step rate over their total time and the segments cut summed.

    python bench/async_overlap.py --out /tmp/async                     # CPU: vLLM's CPU build
    python bench/async_overlap.py --out /tmp/async --gpu                # GPU 0 serves, GPU 1 trains
    python bench/async_overlap.py --out /tmp/async --smoke --server 127.0.0.1:8000

``--gpu`` uses a Qwen3-0.6B-shaped model (28 layers, width 1,024; random weights, the tiny tokenizer),
longer responses and bf16, the server on ``CUDA_VISIBLE_DEVICES=0`` and the trainer on 1 (the colocated run
on 0). Needs vLLM (its CPU build on a CPU machine); ``--server`` reuses a running ``stapo serve`` of the
same model instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _server_busy import BusyProbe  # noqa: E402  (bench/ is on sys.path)
from stapo.run_dir import METRICS_FILE, read_metrics  # noqa: E402

# sizes of one step: prompts x G responses of up to max_response_length tokens
SIZES = {
    "cpu": ["trainer.train_batch_size=16", "trainer.mini_batch_size=8", "rollout.group_size=8",
            "rollout.max_response_length=48", "model.dtype=fp32"],
    "gpu": ["trainer.train_batch_size=64", "trainer.mini_batch_size=16", "rollout.group_size=8",
            "rollout.max_response_length=1024", "model.dtype=bf16", "trainer.zero_stage=1",
            "trainer.max_tokens_per_micro_batch=16384"],
    "smoke": ["trainer.train_batch_size=4", "trainer.mini_batch_size=2", "rollout.group_size=4",
              "rollout.max_response_length=16", "model.dtype=fp32"],
    "long_tail_cpu": ["trainer.train_batch_size=16", "trainer.mini_batch_size=8", "rollout.group_size=4",
                      "rollout.max_response_length=384", "model.dtype=fp32"],
    "long_tail_gpu": ["trainer.train_batch_size=64", "trainer.mini_batch_size=16", "rollout.group_size=8",
                      "rollout.max_response_length=8192", "model.dtype=bf16", "trainer.zero_stage=1",
                      "trainer.max_tokens_per_micro_batch=16384"],
}
COMMON = ["data.eval_size=8", "trainer.eval_every=0", "trainer.save_every=0", "trainer.export_hf=false",
          "inspect.record_every=0", "logging.log_samples_every=0", "logging.tensorboard=false",
          "logging.plot=false", "logging.progress=false", "tiny.warm_start_steps=0", "optim.lr=1e-5"]
MODES = {"colocated": ["rollout.engine=vllm"],
         "server k=0": ["rollout.mode=server"],
         "server k=1": ["rollout.mode=server", "rollout.max_staleness=1"]}
LONG_TAIL_MODES = {"server k=0": ["rollout.mode=server"],
                   "server k=1": ["rollout.mode=server", "rollout.max_staleness=1"],
                   "server k=1 partial": ["rollout.mode=server", "rollout.max_staleness=1", "rollout.partial=true"]}
PROBE_PERIOD_S = 0.25  # samples of the server's running-request gauge, ~5 ms of CPU each, beside 2-core runs
SMOKE_PROBE_PERIOD_S = 0.02  # the smoke's generations last ~0.3 s
COLUMNS = ("time_step", "time_rollout", "idle_frac", "generation_s", "time_update", "time_sync",
           "policy_staleness", "mismatch_logp_abs_max")
LONG_TAIL_COLUMNS = ("steps_per_min", "time_step", "time_stats", "idle_frac", "server_idle_frac",
                     "rollout_tokens_per_s", "time_sync", "policy_staleness_mean", "partial_interrupted")
TOTALS = {"partial_interrupted"}  # counted over steps 2+, not a median: cuts happen in the few long steps


def build_model(out: Path, gpu: bool) -> Path:
    from stapo.tiny.model import TinySpec, build_tiny_model

    if not gpu:
        return build_tiny_model()
    spec = TinySpec(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)  # Qwen3-0.6B's shape
    return build_tiny_model(out / "model_qwen3_0p6b_shape", spec=spec)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, out: Path, gpu: bool) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": "0"} if gpu else {})}
    cmd = [sys.executable, "-m", "stapo.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16" if gpu else "float32", "--max-model-len", "9216" if gpu else "512", "--seed", "0"]
    log = (out / "server.log").open("ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited {proc.returncode}; see {out / 'server.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"the vLLM server did not start in 900 s; see {out / 'server.log'}")


def run_mode(mode: str, model: Path, server: str, out: Path, size: str, steps: int, gpu: bool,
             long_tail: bool = False) -> list[dict]:
    run_dir = out / mode.replace(" ", "_").replace("=", "")
    imports = ["--import", str(ROOT / "bench" / "_long_tail.py")] if long_tail else []
    cmd = [sys.executable, "-m", "stapo.cli", "train", *imports, f"model.path={model}",
           f"trainer.output_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.resume=never", *COMMON,
           *SIZES[size], *(LONG_TAIL_MODES if long_tail else MODES)[mode], f"rollout.server.addresses=[{server}]"]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": "0" if mode == "colocated" else "1"} if gpu else {})}
    period = SMOKE_PROBE_PERIOD_S if size == "smoke" else PROBE_PERIOD_S
    probe = None if mode == "colocated" else BusyProbe(server, run_dir / METRICS_FILE, period)
    if probe is not None:
        probe.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        if probe is not None:
            probe.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [r for r in read_metrics(run_dir / METRICS_FILE) if "loss" in r]
    for r in rows:
        r["idle_frac"] = r["time_rollout"] / r["time_step"]
        if probe is not None:
            r["server_idle_frac"] = 1.0 - probe.busy_frac(r["step"])
            r["server_tokens"] = probe.generated_tokens(r["step"])
        r["rollout_tokens_per_s"] = r["response_length_mean"] * rows_per_step(size) / r["time_step"]
    return rows


def rows_per_step(size: str) -> int:
    """Responses per step of a size's settings (train_batch_size x group_size)."""
    settings = dict(a.split("=", 1) for a in SIZES[size])
    return int(settings["trainer.train_batch_size"]) * int(settings["rollout.group_size"])


def summarize(results: dict[str, list[dict]], columns: tuple[str, ...] = COLUMNS) -> str:
    """Medians of steps 2+ (step 1 includes start-up work), but ``steps_per_min`` over their whole time and
    `TOTALS` summed: a median of a few heavy-tailed steps hides the long ones."""
    def summary(rows, key):
        measured = rows[1:] or rows
        if key == "steps_per_min":
            return 60.0 * len(measured) / sum(r["time_step"] for r in measured)
        values = [r[key] for r in measured if key in r]
        if not values:
            return float("nan")
        return sum(values) if key in TOTALS else statistics.median(values)

    lines = ["| mode | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for mode, rows in results.items():
        lines.append(f"| {mode} | " + " | ".join(f"{summary(rows, c):.3g}" for c in columns) + " |")
    base = summary(results["server k=0"], "steps_per_min")
    for mode in [m for m in results if m.startswith("server k=1")]:
        lines.append(f"\n{mode} vs k=0: {summary(results[mode], 'steps_per_min') / base:.2f}x the step rate "
                     "(steps 2+, total time)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="run directories, server log, results.json")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gpu", action="store_true", help="Qwen3-0.6B shape, server on GPU 0, trainer on GPU 1")
    ap.add_argument("--smoke", action="store_true", help="2 steps of a few tiny rows (the lane's check)")
    ap.add_argument("--server", help="host:port of a running `stapo serve` of the same model (else one is started)")
    ap.add_argument("--long-tail", action="store_true",
                    help="heavy-tailed response lengths; lock-step, k=1 and k=1 + partial rollouts")
    args = ap.parse_args(argv)
    if args.gpu and args.smoke:
        ap.error("--gpu and --smoke exclude each other")
    args.out.mkdir(parents=True, exist_ok=True)
    size, steps = ("smoke", 2) if args.smoke else ("gpu" if args.gpu else "cpu", args.steps)
    if args.long_tail and not args.smoke:
        size = "long_tail_gpu" if args.gpu else "long_tail_cpu"
    model = build_model(args.out, args.gpu)
    proc, server = (None, args.server) if args.server else start_server(model, args.out, args.gpu)
    modes = LONG_TAIL_MODES if args.long_tail else MODES
    try:
        results = {mode: run_mode(mode, model, server, args.out, size, steps, args.gpu, args.long_tail)
                   for mode in modes}
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"async overlap{', long tail' if args.long_tail else ''}, {size} sizes, {steps} steps, one trainer rank, "
          "one vLLM server\n")
    print(summarize(results, LONG_TAIL_COLUMNS if args.long_tail else COLUMNS))
    return results


if __name__ == "__main__":
    main()
