"""Benchmark: ZeRO-3 → rollout-engine weight sync, flat bucketed vs one gather per parameter.

Launches 2 CPU ranks (gloo), each holding a ZeRO-3 partition of a random-init ~50M-parameter
Qwen3 and a plain copy as the consumer (what a colocated rollout engine's ``load_weights``
does). Prints a Markdown table: median wall time of a full sync into the plain model and of the
gathers alone, CPU seconds of all ranks (stable on a loaded box), speed-ups vs per-parameter
gathering (target: ≥ 2×, docs/benchmarks.md), peak RSS growth and the largest bucket. ``gp<MiB>`` rows
time the previous path (``GatheredParameters`` over a bucket: one all-gather per parameter).

    python bench/weight_sync.py                 # ~47M params, 20 layers, 2 ranks, 5 repetitions
    python bench/weight_sync.py --shape wide    # ~48M params, 10 wider layers
    python bench/weight_sync.py --interleave --buckets-mib 16,256,gp16   # same load for all rows
    python bench/weight_sync.py --smoke         # tiny model, one launch: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from _cpu_ranks import exit_worker, launch_cpu_ranks  # bench/ is on sys.path

MiB = 2**20
# Two ~47M-parameter shapes (tied 32k embedding). "deep" has an LLM-like tensor count (222;
# Qwen3-0.6B has 310), "wide" fewer, larger tensors (112), where per-call overhead matters less.
SHAPES = {
    "deep": dict(vocab_size=32000, hidden_size=384, intermediate_size=1152, num_hidden_layers=20,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    "wide": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "smoke": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16),
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _gathered_parameters_buckets(model, bucket_bytes: int):
    """The previous path, for comparison: ``GatheredParameters`` over each planned bucket
    (DeepSpeed still issues one all-gather per parameter inside it)."""
    import deepspeed

    from stapo.sync.buckets import full_numel, hf_name, plan_buckets

    named = list(model.named_parameters())
    for indices in plan_buckets([full_numel(p) * p.element_size() for _, p in named],
                                bucket_bytes):
        with deepspeed.zero.GatheredParameters([named[i][1] for i in indices]):
            yield [(hf_name(named[i][0]), named[i][1].detach()) for i in indices]


def _buckets_fn(engine, method: str):
    """``per_param``, a bucket size in MiB (flat gather) or ``gp<MiB>`` (previous path)."""
    from stapo.sync.buckets import iter_weight_buckets, iter_weights_per_param

    if method == "per_param":
        return lambda: iter_weights_per_param(engine, copy=False)
    if method.startswith("gp"):
        size = int(float(method[2:]) * MiB)
        return lambda: _gathered_parameters_buckets(engine, size)
    size = int(float(method) * MiB)
    return lambda: iter_weight_buckets(engine, size, copy=False)


def worker(methods: list[str], reps: int, shape: str, interleave: bool) -> None:
    """One rank: build the ZeRO-3 engine and the consumer, time ``reps`` syncs per method.

    ``interleave`` alternates the methods rep by rep (same machine load for all; RSS growth is
    then not per method). Rank 0 prints one ``RESULT`` line per method.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.distributed.process_group import barrier, init_distributed, reduce_metrics
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.sync.buckets import StateDictConsumer

    info = init_distributed()
    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True)
    torch.manual_seed(0)
    engine = build_engine(Qwen3ForCausalLM(config), lr=1e-6, warmup_steps=0, grad_accum_steps=1,
                          bf16=False)
    consumer = StateDictConsumer(Qwen3ForCausalLM(config))
    n_params = sum(p.ds_numel for p in engine.module.parameters())
    stats = {m: {"times": [], "gather_times": [], "cpu": [], "largest": 0, "buckets": 0,
                 "rss_before": _rss_mib(), "rss": 0.0} for m in methods}
    order = ([(rep, m) for rep in range(2 * reps + 2) for m in methods] if interleave
             else [(rep, m) for m in methods for rep in range(2 * reps + 2)])
    for rep, method in order:  # even rep: sync into the consumer, odd: gather only
        st, consume = stats[method], rep % 2 == 0
        barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        n_buckets = 0
        for bucket in _buckets_fn(engine, method)():
            if consume:
                consumer.load_weights(bucket)
            st["largest"] = max(st["largest"], sum(t.numel() * t.element_size() for _, t in bucket))
            n_buckets += 1
            del bucket
        barrier()
        if rep >= 2:  # the first pair warms up the allocator and gloo
            st["times" if consume else "gather_times"].append(time.perf_counter() - start)
            if consume:
                st["cpu"].append(time.process_time() - cpu_start)
        st["buckets"], st["rss"] = n_buckets, _rss_mib() - st["rss_before"]
    for method in methods:
        st = stats[method]
        total = reduce_metrics({"rss": st["rss"], "cpu": statistics.median(st["cpu"])})
        if info.rank == 0:
            print("RESULT " + json.dumps({
                "method": method, "median_s": statistics.median(st["times"]),
                "gather_s": statistics.median(st["gather_times"]), "cpu_s": total["cpu"],
                "buckets": st["buckets"], "largest_mib": st["largest"] / MiB,
                "rss_growth_mib": total["rss"] / info.world_size, "params": n_params}), flush=True)


def _launch(methods: list[str], reps: int, shape: str, world_size: int,
            interleave: bool = False) -> list[dict]:
    args = ["--worker", ",".join(methods), "--reps", str(reps), "--shape", shape] + (
        ["--interleave"] if interleave else [])
    return launch_cpu_ranks(__file__, args, world_size, timeout=900, what=f"weight_sync {methods}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--buckets-mib", default="16,64,256,gp16",
                        help="bucket sizes to compare; gp<MiB> = previous GatheredParameters path")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deep")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, 1 repetition, all methods in one launch "
                             "(RSS not comparable)")
    parser.add_argument("--interleave", action="store_true",
                        help="one launch, methods alternated rep by rep: fair timings on a loaded "
                             "machine (RSS growth not comparable)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker.split(","), args.reps, args.shape, args.interleave)
        exit_worker()
    reps = 1 if args.smoke else max(3, args.reps)
    methods = ["per_param"] + args.buckets_mib.split(",")
    if args.smoke or args.interleave:
        shape = "smoke" if args.smoke else args.shape
        runs = _launch(methods, reps, shape, args.world_size, interleave=args.interleave)
    else:  # one launch per method: RSS high-water marks stay separate
        runs = [r for m in methods for r in _launch([m], reps, args.shape, args.world_size)]
    base, base_gather, base_cpu = (runs[0][k] for k in ("median_s", "gather_s", "cpu_s"))
    shape = ("smoke" if args.smoke else args.shape) + (", interleaved" if args.interleave else "")
    print(f"\nWeight sync, {runs[0]['params'] / 1e6:.1f}M params fp32 ({shape} shape), "
          f"{args.world_size} CPU ranks (gloo), median of {reps}; speed-up = per-parameter / row\n")
    print("| method | bucket | gathers | largest gathered | sync into model | speed-up "
          "| gather only | speed-up | CPU s (all ranks) | speed-up | peak RSS growth |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        method = r["method"]
        name, bucket = (("per-parameter", "-") if method == "per_param" else
                        ("GatheredParameters bucket", f"{method[2:]} MiB") if method[:2] == "gp"
                        else ("flat bucketed", f"{method} MiB"))
        print(f"| {name} | {bucket} | {r['buckets']} | {r['largest_mib']:.1f} MiB "
              f"| {r['median_s'] * 1e3:.0f} ms | {base / r['median_s']:.2f}x "
              f"| {r['gather_s'] * 1e3:.0f} ms | {base_gather / r['gather_s']:.2f}x "
              f"| {r['cpu_s']:.2f} | {base_cpu / r['cpu_s']:.2f}x "
              f"| {r['rss_growth_mib']:.0f} MiB |")
    return runs


if __name__ == "__main__":
    main()
