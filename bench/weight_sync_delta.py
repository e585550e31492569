"""Benchmark: full vs delta weight syncs into a rollout server (``rollout.server.sync``): bytes and seconds per sync.

Two policies, each after real AdamW steps at the paper's learning rate, 1e-6 (bench/_delta_training.py):
(a) the tiny Qwen3 in fp32, as the CPU trainer and the lane's servers hold it; (b) a Qwen3-0.6B-shaped policy
in bf16 (fp32 master weights rounded to bf16, as DeepSpeed's bf16 training sends them). Each step's weights are
synced through stapo's own path — `ServerEngine` (rank 0's copy, the encoding, the checksums), one gloo
broadcast per bucket, the worker's side in another process (bench/_sync_receiver.py: stapo's worker code, a
dict in place of vLLM's model) — once with ``rollout.server.sync: full`` and once with ``delta``, each into a fresh
receiver; both receivers must end with the same bytes. Prints per policy the bytes sent per sync against the
dense bytes, the seconds per sync, the changed fraction per step (measured, and expected once training is long
underway) and what that fraction means for 8B / 14B / 32B bf16 policies at 25 and 100 Gb/s.

    python bench/weight_sync_delta.py                 # tiny + Qwen3-0.6B shape (28 layers): 5 steps, 13 GiB peak
    python bench/weight_sync_delta.py --layers 8      # 8 of the 28 layers: less memory
    python bench/weight_sync_delta.py --smoke         # small shapes, 2 steps: checks the script runs
    python bench/weight_sync_delta.py --gpu           # two GPUs: training and rank 0 on cuda:0, receiver on cuda:1
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, tie_word_embeddings=True, num_hidden_layers=2)
POLICIES = {"Qwen3-8B": 8.2e9, "Qwen3-14B": 14.8e9, "Qwen3-32B": 32.8e9}  # parameters (model cards)


def train(spec: dict) -> list[dict]:
    import torch
    from transformers import Qwen3Config

    from _delta_training import train_and_record

    return train_and_record(Qwen3Config(**spec["config"]), getattr(torch, spec["dtype"]), spec["steps"], spec["lr"],
                            spec["tokens"], Path(spec["out"]), spec["device"])


def _receiver(device: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1") if device == "cuda" else dict(os.environ)
    proc = subprocess.Popen([sys.executable, str(HERE / "_sync_receiver.py"), str(port), device], env=env,
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "READY":
        raise SystemExit("the sync receiver did not start")
    return proc, f"127.0.0.1:{port}"


def sync_pass(spec: dict) -> dict:
    """One mode's pass: every step's weights into a fresh receiver, one sync each; the receiver's checksum of
    what it serves at the end."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.servers.client import ServerClient
    from stapo.servers.engine import ServerEngine, ServerLimits
    from stapo.sync.buckets import sync_weights

    out, device = Path(spec["out"]), spec["device"]
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(Qwen3Config(**spec["config"]), dtype=getattr(torch, spec["dtype"]))
    model.load_state_dict(torch.load(out / "step_0.pt"), strict=False)  # a tied head follows the embedding
    params = dict(model.named_parameters())
    receiver, address = _receiver(device)
    steps = []
    try:
        engine = ServerEngine([address], pad_token_id=0, sync=spec["mode"], limits=ServerLimits(sync_timeout_s=1800))
        for step in range(spec["steps"] + 1):
            with torch.no_grad():
                for name, (positions, values) in (torch.load(out / f"step_{step}.pt") if step else {}).items():
                    params[name].view(-1)[positions.long().to(device)] = values.to(device)
            stats = sync_weights(model, engine, spec["bucket_mb"] * MiB, version=step)
            if not engine.last_sync.ok:
                raise SystemExit(f"sync {step} ({spec['mode']}) failed: {engine.last_sync.error}")
            t = stats.transfer
            steps.append({"step": step, "seconds": stats.seconds, "sent": t.sent_bytes, "dense": t.dense_bytes,
                          "changed_frac": t.changed_frac})
        served = ServerClient(address).rpc_json("stapo_weight_checksums", timeout_s=600)[0]["served"]
        return {"steps": steps, "served": served}
    finally:
        receiver.kill()
        receiver.wait()


def measure(label: str, config: dict, dtype: str, args, tmp: Path) -> dict:
    out = tmp / label.replace(" ", "_")
    out.mkdir()
    base = {"config": config, "dtype": dtype, "steps": args.steps, "out": str(out), "device": "cuda" if args.gpu else "cpu"}
    training = train({**base, "lr": args.lr, "tokens": args.tokens})  # its memory is freed before the syncs
    passes = {mode: sync_pass({**base, "mode": mode, "bucket_mb": args.bucket_mb}) for mode in ("full", "delta")}
    if passes["full"]["served"] != passes["delta"]["served"]:
        raise SystemExit(f"{label}: the delta-synced receiver does not hold the full-synced one's bytes")
    return {"label": label, "dtype": dtype, "training": training, "passes": passes}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[1:])  # the steps after the first (whole) sync


def report(results: list[dict], args) -> None:
    print(f"\nFull vs delta weight syncs, {args.steps} AdamW steps at lr {args.lr:g} ({args.tokens} random tokens "
          f"each), {args.bucket_mb} MiB buckets, one receiver over gloo ({'GPU' if args.gpu else 'CPU'}); "
          f"medians of syncs 1-{args.steps} (sync 0 sends everything in both modes)\n")
    print("| policy | dense per sync | full: sent, s | delta: sent, s | delta / full bytes | first sync s (full / delta) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        full, delta = r["passes"]["full"]["steps"], r["passes"]["delta"]["steps"]
        ratio = _median(delta, "sent") / _median(full, "sent")
        print(f"| {r['label']} | {full[0]['dense'] / MiB:.1f} MiB | {_median(full, 'sent') / MiB:.1f} MiB, "
              f"{_median(full, 'seconds'):.2f} | {_median(delta, 'sent') / MiB:.2f} MiB, {_median(delta, 'seconds'):.2f} "
              f"| {ratio:.3f} | {full[0]['seconds']:.2f} / {delta[0]['seconds']:.2f} |")
    print("\n| policy | step | changed (measured) | expected, long run | embedding | attention | mlp | norms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["training"]:
            kinds = " | ".join(f"{100 * row.get(f'{k}_frac', float('nan')):.2f}%" for k in ("embed", "attention", "mlp", "norm"))
            print(f"| {r['label']} | {row['step']} | {100 * row['changed_frac']:.2f}% | {100 * row['expected_frac']:.2f}% "
                  f"| {kinds} |")
    bf16 = [r for r in results if r["dtype"] == "bfloat16"]
    if bf16:
        project(bf16[-1])


def project(result: dict) -> None:
    """On paper: a bf16 policy of P parameters, changed fraction f: full 2P bytes, delta 6fP (int32 position +
    bf16 value per change) while f < 1/3; seconds at a link's rate (one broadcast reaches every server)."""
    measured = statistics.median(r["changed_frac"] for r in result["training"])
    expected = statistics.median(r["expected_frac"] for r in result["training"])
    print(f"\nOn paper, from {result['label']}: changed fraction {100 * measured:.2f}% (measured, median) and "
          f"{100 * expected:.2f}% (expected long run); bytes on the wire only (not rank 0's compare and checksum)\n")
    print("| policy | full | delta (measured f) | delta (long-run f) | 25 Gb/s: full / delta (measured, long run) "
          "| 100 Gb/s: full / delta (measured, long run) |")
    print("|---|---|---|---|---|---|")
    for name, params in POLICIES.items():
        full = 2 * params
        deltas = [min(6 * f, 2) * params for f in (measured, expected)]
        secs = {gbps: [b * 8 / (gbps * 1e9) for b in (full, *deltas)] for gbps in (25, 100)}
        print(f"| {name} | {full / 1e9:.1f} GB | {deltas[0] / 1e9:.2f} GB | {deltas[1] / 1e9:.2f} GB | "
              + " | ".join(f"{s[0]:.1f} s / {s[1]:.2f} s, {s[2]:.2f} s" for s in secs.values()) + " |")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (the paper's: 1e-6)")
    parser.add_argument("--tokens", type=int, default=64, help="random tokens of each step's batch")
    parser.add_argument("--layers", type=int, default=28, help="layers of the Qwen3-0.6B shape (28: all)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="rollout.sync_bucket_mb")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of this process and the receiver's")
    parser.add_argument("--smoke", action="store_true", help="small shapes, 2 steps")
    parser.add_argument("--gpu", action="store_true", help="two GPUs: rank 0 on cuda:0 (NCCL), receiver on cuda:1")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the receivers'
    if args.smoke:
        args.steps, args.bucket_mb = 2, 1
    from transformers import AutoConfig

    from stapo.tiny import build_tiny_model

    tiny = {k: v for k, v in AutoConfig.from_pretrained(build_tiny_model()).to_dict().items()
            if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "tie_word_embeddings")}
    big = SMOKE if args.smoke else {**QWEN3_06B, "num_hidden_layers": args.layers}
    name = "smoke shape" if args.smoke else f"Qwen3-0.6B shape{'' if args.layers == 28 else f', {args.layers} of 28 layers'}"
    with tempfile.TemporaryDirectory(prefix="stapo-delta-bench-") as tmp:
        results = [measure("tiny, fp32", tiny, "float32", args, Path(tmp)),
                   measure(f"{name}, bf16", big, "bfloat16", args, Path(tmp))]
    report(results, args)
    return results


if __name__ == "__main__":
    main()
