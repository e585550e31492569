"""Benchmark: the ``zero:`` settings (tuned for one node) vs DeepSpeed's defaults, ZeRO-3 on 2 CPU ranks.

Each rank trains a random-init model with Qwen3-0.6B's layer shape (hidden 1,024, GQA 16/8 heads of
128, MLP 3,072; 4 layers instead of 28, a 384-token vocabulary: ~63M parameters, so persistence and
bucket thresholds see the real tensor sizes) for a few steps of ``--micro`` micro-batches, through the
trainer's own passes: a step is the no-grad stats pass and the update (``policy_stats`` and
``update_minibatch``' forward, :func:`stapo.distributed.policy.response_token_stats` on packed rows, with
exact accumulation), so the ZeRO-3 parameter trace sees the module order the trainer produces.
The two settings alternate step by step (same machine load). Prints a Markdown table: median step
time, CPU seconds, and the collectives one step issues (counted with DeepSpeed's comms logger in a
separate step, since the logger synchronizes every op).

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

from _cpu_ranks import launch_cpu_ranks  # bench/ is on sys.path

SHAPES = {
    "qwen3_0p6b_4layers": dict(vocab_size=384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "smoke": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16),
}
SETTINGS = ("deepspeed_defaults", "tuned")


def _tuning(setting: str):
    from stapo.config import STAPOConfig
    from stapo.trainer.components import zero_tuning
    from stapo.distributed.deepspeed_engine import ZeroTuning

    return ZeroTuning() if setting == "deepspeed_defaults" else zero_tuning(STAPOConfig())


def _inputs(ids):
    """Micro-batch rows ``(1, T)`` as the trainer's packed teacher-forced inputs: the first half of
    each row is the prompt, the second half the response."""
    import torch

    from stapo.distributed.policy import teacher_forced_inputs

    half = ids.shape[-1] // 2
    out = []
    for micro in ids:
        prompt_mask = torch.ones(micro.shape[0], half, dtype=torch.bool)
        response_mask = torch.ones(micro.shape[0], micro.shape[1] - half, dtype=torch.bool)
        out.append(teacher_forced_inputs(micro[:, :half], prompt_mask, micro[:, half:], response_mask, packed=True))
    return out


def _step(engine, inputs) -> None:
    """One trainer step over the micro-batches ``inputs``: the no-grad stats pass, then the update
    (mean response log-likelihood as the loss, summed exactly over micro-batches)."""
    import torch

    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.policy import response_token_stats

    with torch.no_grad():
        for micro in inputs:
            response_token_stats(engine.module, micro, temperature=1.0, chunk_size=1024)
    accumulation = GradientAccumulation(engine, len(inputs))
    for micro in inputs:
        logprobs, _ = response_token_stats(engine.module, micro, temperature=1.0, chunk_size=1024, runner=engine)
        accumulation.backward(-logprobs.sum() / micro.response_mask.sum() / len(inputs))
    accumulation.step()


def _count_collectives(engine, ids) -> dict[str, int]:
    import deepspeed.comm as ds_comm
    from deepspeed.comm.comm import comms_logger

    comms_logger.reset_data()
    ds_comm.configure(enabled=True, prof_all=True)
    _step(engine, ids)
    ds_comm.configure(enabled=False)
    counts = collections.Counter()
    for name, sizes in comms_logger.comms_dict.items():
        counts[name.split("|")[0]] += sum(record[0] for record in sizes.values())
    return dict(counts)


def worker(shape: str, steps: int, micro: int, tokens: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.distributed.process_group import barrier, init_distributed, reduce_metrics
    from stapo.distributed.deepspeed_engine import build_engine

    info = init_distributed()
    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(info.rank)
    ids = _inputs(torch.randint(0, config.vocab_size, (micro, 1, tokens), generator=gen))
    engines = {}
    for setting in SETTINGS:
        torch.manual_seed(0)
        engines[setting] = build_engine(Qwen3ForCausalLM(config), lr=1e-6, warmup_steps=0, grad_accum_steps=micro,
                                        bf16=False, zero_tuning=_tuning(setting))
    times = {s: [] for s in SETTINGS}
    cpu = {s: [] for s in SETTINGS}
    for rep in range(steps + 1):  # rep 0 warms up
        for setting in SETTINGS:
            barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            _step(engines[setting], ids)
            barrier()
            if rep > 0:
                times[setting].append(time.perf_counter() - start)
                cpu[setting].append(time.process_time() - cpu_start)
    for setting in SETTINGS:
        engine = engines[setting]
        counts = _count_collectives(engine, ids)
        persisted = sum(1 for p in engine.module.parameters() if p.ds_persist)
        total = reduce_metrics({"cpu": statistics.median(cpu[setting])})
        if info.rank == 0:
            print("RESULT " + json.dumps({
                "setting": setting, "step_s": statistics.median(times[setting]), "cpu_s": total["cpu"],
                "collectives": counts, "persisted": persisted,
                "tensors": sum(1 for _ in engine.module.parameters()),
                "params": sum(p.ds_numel for p in engine.module.parameters())}), flush=True)


def _launch(shape: str, steps: int, micro: int, tokens: int, world_size: int) -> list[dict]:
    args = ["--worker", "--shape", shape, "--steps", str(steps), "--micro", str(micro), "--tokens", str(tokens)]
    return launch_cpu_ranks(__file__, args, world_size, timeout=1800, what="zero_tuning")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_0p6b_4layers")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per setting")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per micro-batch (one row)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one timed step")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.steps, args.micro, args.tokens = "smoke", 1, 2, 16
    if args.worker:
        worker(args.shape, args.steps, args.micro, args.tokens)
        return []
    runs = _launch(args.shape, args.steps, args.micro, args.tokens, args.world_size)
    base = runs[0]
    ops = sorted({op for r in runs for op in r["collectives"]})
    print(f"\nZeRO-3 settings, {base['params'] / 1e6:.1f}M params fp32 ({args.shape}), {args.world_size} CPU ranks "
          f"(gloo), {args.micro} micro-batches x {args.tokens} tokens per step, median of {args.steps} "
          "interleaved steps. CPU only: the GPU effect is not measured here.\n")
    print("| setting | tensors kept whole | step s | vs defaults | CPU s (all ranks) | "
          + " | ".join(f"{op} / step" for op in ops) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(ops))
    for r in runs:
        print(f"| {r['setting']} | {r['persisted']} / {r['tensors']} | {r['step_s']:.2f} "
              f"| {base['step_s'] / r['step_s']:.2f}x | {r['cpu_s']:.2f} | "
              + " | ".join(str(r["collectives"].get(op, 0)) for op in ops) + " |")
    return runs


if __name__ == "__main__":
    main()
