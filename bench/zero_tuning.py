"""Benchmark: the ``zero:`` settings (tuned for one node) vs DeepSpeed's defaults, ZeRO-3 on 2 CPU ranks.

Each rank trains a random-init model with Qwen3-0.6B's layer shape (hidden 1,024, GQA 16/8 heads of
128, MLP 3,072; 4 layers instead of 28, a 384-token vocabulary: ~63M parameters, so persistence and
bucket thresholds see the real tensor sizes) for a few steps through the trainer's own passes: a step
is the no-grad stats pass over ``--micro`` rows (one micro-batch each), then ``--minis`` mini-batches,
each a fresh stats pass and an update (``policy_stats`` and ``update_minibatch``, as
``STAPOTrainer.step`` with ``mask.stats_source: fresh``), so the ZeRO-3 parameter trace sees the module
order the trainer produces. Three settings: DeepSpeed's defaults, the tuned ``zero:`` settings on
DeepSpeed's single trace per engine (the code before ``stapo.distributed.zero3_trace``), and the tuned
settings with a trace per pass kind (what the trainer runs). They alternate step by step (same
machine load). Prints a Markdown table: median step time, CPU seconds, the share of the coordinator's
sub-module fetches made on a complete trace (the ones that can prefetch) and the collectives one step
issues (counted with DeepSpeed's comms logger in a separate step, since the logger synchronizes every op).

This measures CPU + gloo only: no CUDA streams, so ``overlap_comm`` cannot overlap anything here, and
a 2-rank gloo all-gather costs nothing like NVLink. The GPU effect is NOT measured by this script.

    python bench/zero_tuning.py            # 2 ranks, 3 timed steps per setting
    python bench/zero_tuning.py --smoke    # tiny model, one step each: checks the script runs
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

from _cpu_ranks import exit_worker, launch_cpu_ranks  # bench/ is on sys.path

SHAPES = {
    "qwen3_0p6b_4layers": dict(vocab_size=384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "smoke": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16),
}
SETTINGS = ("deepspeed_defaults", "tuned_single_trace", "tuned")


def _tuning(setting: str):
    from stapo.config import STAPOConfig
    from stapo.trainer.components import zero_tuning
    from stapo.distributed.deepspeed_engine import ZeroTuning

    return ZeroTuning() if setting == "deepspeed_defaults" else zero_tuning(STAPOConfig())


def _batch(ids):
    """Rows ``(n, T)`` as a train batch: the first half of each row is the prompt, the second half the
    response; advantages of both signs so the update has a gradient."""
    import torch

    from stapo.trainer.update import TrainBatch

    half = ids.shape[-1] // 2
    n = ids.shape[0]
    ones = lambda t: torch.ones(t.shape, dtype=torch.bool)  # noqa: E731
    zeros = torch.zeros(n, ids.shape[1] - half)
    return TrainBatch(ids[:, :half], ones(ids[:, :half]), ids[:, half:], ones(ids[:, half:]),
                      torch.linspace(-1.0, 1.0, n), zeros, zeros)


def _step(engine, batch, minis: int) -> None:
    """One trainer step: the no-grad stats pass, then per mini-batch a fresh stats pass and the update."""
    import dataclasses

    from stapo.trainer.update import UpdateOptions, policy_stats, update_minibatch

    opts = UpdateOptions(micro_batch_size=1, chunk_size=1024)
    logprobs, entropy = policy_stats(engine.module, batch, opts)
    batch = dataclasses.replace(batch, old_logprobs=logprobs, old_entropy=entropy)
    size = -(-len(batch) // minis)
    for k, start in enumerate(range(0, len(batch), size)):
        mini = batch.rows(slice(start, start + size))
        if k > 0:
            policy_stats(engine.module, mini, opts)
        update_minibatch(engine, engine.module, mini, mini.trainable, opts)


def _count_fetches():
    """Wrap DeepSpeed's coordinator: count sub-module fetches and those made on a complete trace."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    counts = collections.Counter()
    fetch = PartitionedParameterCoordinator._fetch_sub_module_impl

    def spy(self, current_submodule, forward, is_leaf):
        counts["fetches"] += 1
        counts["complete"] += int(self.is_complete_trace())
        return fetch(self, current_submodule, forward, is_leaf)

    PartitionedParameterCoordinator._fetch_sub_module_impl = spy
    return counts


def _count_collectives(engine, batch, minis: int) -> dict[str, int]:
    import deepspeed.comm as ds_comm
    from deepspeed.comm.comm import comms_logger

    comms_logger.reset_data()
    ds_comm.configure(enabled=True, prof_all=True)
    _step(engine, batch, minis)
    ds_comm.configure(enabled=False)
    counts = collections.Counter()
    for name, sizes in comms_logger.comms_dict.items():
        counts[name.split("|")[0]] += sum(record[0] for record in sizes.values())
    return dict(counts)


def worker(shape: str, steps: int, micro: int, minis: int, tokens: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.distributed import zero3_trace
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.distributed.process_group import barrier, init_distributed, reduce_metrics

    info = init_distributed()
    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(info.rank)
    batch = _batch(torch.randint(0, config.vocab_size, (micro, tokens), generator=gen))
    engines = {}
    for setting in SETTINGS:
        torch.manual_seed(0)
        engines[setting] = build_engine(Qwen3ForCausalLM(config), lr=1e-6, warmup_steps=0, grad_accum_steps=1,
                                        bf16=False, zero_tuning=_tuning(setting))
        if setting != "tuned":  # DeepSpeed's one trace per engine: the code before per-pass traces
            zero3_trace.unregister(engines[setting].module)
    times = {s: [] for s in SETTINGS}
    cpu = {s: [] for s in SETTINGS}
    fetches = {s: collections.Counter() for s in SETTINGS}
    counter = _count_fetches()
    for rep in range(steps + 1):  # rep 0 warms up (and records the traces)
        for setting in SETTINGS:
            barrier()
            counter.clear()
            start, cpu_start = time.perf_counter(), time.process_time()
            _step(engines[setting], batch, minis)
            barrier()
            if rep > 0:
                times[setting].append(time.perf_counter() - start)
                cpu[setting].append(time.process_time() - cpu_start)
                fetches[setting].update(counter)
    for setting in SETTINGS:
        engine = engines[setting]
        counts = _count_collectives(engine, batch, minis)
        persisted = sum(1 for p in engine.module.parameters() if p.ds_persist)
        total = reduce_metrics({"cpu": statistics.median(cpu[setting])})
        if info.rank == 0:
            print("RESULT " + json.dumps({
                "setting": setting, "step_s": statistics.median(times[setting]), "cpu_s": total["cpu"],
                "collectives": counts, "persisted": persisted,
                "complete_share": fetches[setting]["complete"] / max(fetches[setting]["fetches"], 1),
                "tensors": sum(1 for _ in engine.module.parameters()),
                "params": sum(p.ds_numel for p in engine.module.parameters())}), flush=True)


def _launch(shape: str, steps: int, micro: int, minis: int, tokens: int, world_size: int) -> list[dict]:
    args = ["--worker", "--shape", shape, "--steps", str(steps), "--micro", str(micro), "--minis", str(minis),
            "--tokens", str(tokens)]
    return launch_cpu_ranks(__file__, args, world_size, timeout=1800, what="zero_tuning")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_0p6b_4layers")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting")
    parser.add_argument("--micro", type=int, default=4, help="rows per rank and step (one micro-batch each)")
    parser.add_argument("--minis", type=int, default=4,
                        help="mini-batches (optimizer steps) per step; as many as rows: one update "
                             "micro-batch each, as in the tiny recipe")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per row (half prompt, half response)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one timed step")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.steps, args.micro, args.minis, args.tokens = "smoke", 1, 4, 4, 16
    if args.worker:
        worker(args.shape, args.steps, args.micro, args.minis, args.tokens)
        exit_worker()
    runs = _launch(args.shape, args.steps, args.micro, args.minis, args.tokens, args.world_size)
    base = runs[0]
    ops = sorted({op for r in runs for op in r["collectives"]})
    print(f"\nZeRO-3 settings, {base['params'] / 1e6:.1f}M params fp32 ({args.shape}), {args.world_size} CPU ranks "
          f"(gloo), {args.micro} rows x {args.tokens} tokens per rank and step in {args.minis} mini-batches, "
          f"median of {args.steps} interleaved steps. CPU only: the GPU effect is not measured here.\n")
    print("| setting | tensors kept whole | step s | vs defaults | CPU s (all ranks) | fetches on a complete trace | "
          + " | ".join(f"{op} / step" for op in ops) + " |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(ops))
    for r in runs:
        print(f"| {r['setting']} | {r['persisted']} / {r['tensors']} | {r['step_s']:.2f} "
              f"| {base['step_s'] / r['step_s']:.2f}x | {r['cpu_s']:.2f} | {100 * r['complete_share']:.0f}% | "
              + " | ".join(str(r["collectives"].get(op, 0)) for op in ops) + " |")
    return runs


if __name__ == "__main__":
    main()
