"""Benchmark: one training step's GPU phases, padded rows vs packed token-budget micro-batches, ZeRO-1 vs 3.

A Qwen3-0.6B-shaped policy (28 layers, width 1,024, GQA 16/8 heads of 128, MLP 3,072; random weights
from ``transformers.Qwen3Config``, no hub download; the tiny tokenizer's 384-token vocabulary unless
``--vocab``) on a synthetic RL batch: 512 sequences in groups of G = 8, prompts of 48-64 tokens,
responses of 0.2-1.0 x 512 tokens (uniform), random token ids, advantages +1/-1 (half of each group).
Times, for each configuration, the no-grad stats pass over the whole batch and the update over 4
mini-batches (mask ``stapo``, clipped surrogate, backward, optimizer step), after one warm-up of each:

* ``padded``: rows padded to the longest, ``--micro`` (8) rows per micro-batch — the path before packing;
* ``packed``: padding-free packed rows, micro-batches cut by a ``--budget`` token budget (the stats
  pass takes twice the budget);

each under ZeRO-1 (the one-GPU setting: bf16 needs stage >= 1 for fp32 gradient accumulation) and ZeRO-3
(the project's ``build_engine`` with the ``zero:`` defaults, in a 1-rank process group). Prints a Markdown
table: seconds, real tokens/s and MFU per phase (:mod:`stapo.telemetry.mfu`: the lm_head counted at response
positions only, where the passes apply it; MFU is left blank without a known GPU), peak memory, and
speed-ups.

    python bench/gpu_step.py                          # the shape above, bf16 on one GPU
    python bench/gpu_step.py --vocab 151936           # with Qwen3's real vocabulary
    python bench/gpu_step.py --attn flash_attention_2 --budget 32768
    python bench/gpu_step.py --smoke                  # 2 layers, width 64, 16 sequences: CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.tiny.tokenizer import VOCAB_SIZE
from stapo.telemetry.mfu import causal_context_length, device_peak_flops, forward_flops, phase_throughput

SHAPES = {
    "qwen3_0p6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
}
# sequences, G, prompt length range, max response, mini-batches, rows per micro-batch, token budget
WORKLOADS = {
    "qwen3_0p6b": dict(sequences=512, group=8, prompt=(48, 64), response=512, minibatches=4, micro=8, budget=16384),
    "smoke": dict(sequences=16, group=8, prompt=(6, 8), response=24, minibatches=4, micro=2, budget=64),
}
ONE_ROW_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass(frozen=True)
class Layout:
    name: str  # "padded" or "packed"
    packing: bool
    micro_batch_size: int
    max_tokens: int | None  # token budget of an update micro-batch; None: count rows

    @property
    def cut(self) -> str:
        return f"{self.max_tokens} tokens" if self.max_tokens else f"{self.micro_batch_size} rows"


def synthetic_batch(n: int, group: int, prompt: tuple[int, int], response: int, vocab: int, seed: int = 0):
    """RL-shaped tensors: left-padded prompts, right-padded responses, +-1 advantages (half per group)."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=gen)
    r_len = torch.randint(max(1, round(0.2 * response)), response + 1, (n,), generator=gen)
    cols_p, cols_r = torch.arange(prompt[1]), torch.arange(response)
    prompt_mask = cols_p[None, :] >= (prompt[1] - p_len)[:, None]  # (B, Lp) left padding
    response_mask = cols_r[None, :] < r_len[:, None]  # (B, T) right padding
    prompt_ids = torch.randint(0, vocab, (n, prompt[1]), generator=gen) * prompt_mask
    response_ids = torch.randint(0, vocab, (n, response), generator=gen) * response_mask
    signs = torch.tensor([1.0, -1.0]).repeat_interleave(group // 2).repeat(n // group)  # (B,)
    order = torch.argsort(torch.rand(n // group, group, generator=gen), dim=1).flatten() + \
        torch.arange(0, n, group).repeat_interleave(group)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                response_mask=response_mask, advantages=signs[order], lengths=(p_len + r_len).tolist())


def run_phases(engine, seqs: dict, layout: Layout, minibatches: int, attn: str, sync) -> dict[str, float]:
    """The ONE place that calls the trainer's update API: stats pass, then ``minibatches`` updates.

    Returns seconds per phase and the update's micro-batch count.
    """
    from stapo.losses import TokenStats, build_mask
    from stapo.trainer.update import TrainBatch, UpdateOptions, policy_stats, update_minibatch

    opts = UpdateOptions(packing=layout.packing, pack_one_row=layout.packing and attn in ONE_ROW_ATTENTION,
                         micro_batch_size=layout.micro_batch_size, max_tokens_per_micro_batch=layout.max_tokens,
                         max_tokens_per_stats_micro_batch=None, temperature=1.0)
    parts = {k: seqs[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages")}
    zeros = torch.zeros(seqs["response_ids"].shape)
    model, mask = engine.module, build_mask("stapo")
    sync()
    start = time.perf_counter()
    logprobs, entropy = policy_stats(model, TrainBatch(**parts, old_logprobs=zeros, old_entropy=zeros), opts)
    sync()
    stats_s = time.perf_counter() - start
    batch = TrainBatch(**parts, old_logprobs=logprobs, old_entropy=entropy)
    rows = len(batch) // minibatches
    micro_batches = 0.0
    start = time.perf_counter()
    for i in range(minibatches):
        part = batch.rows(slice(i * rows, (i + 1) * rows))
        keep = mask.apply(TokenStats(part.old_logprobs, part.old_entropy, part.advantages, part.response_mask)).keep
        sums = update_minibatch(engine, model, part, keep, opts)
        micro_batches += float(sums.get("micro_batches", float("nan")))
    sync()
    return {"stats_s": stats_s, "update_s": time.perf_counter() - start, "micro_batches": micro_batches}


def _build_engine(config, zero_stage: int, grad_accum_steps: int, micro: int, bf16: bool):
    from transformers import Qwen3ForCausalLM

    from stapo.config import STAPOConfig
    from stapo.trainer.components import zero_tuning
    from stapo.distributed.deepspeed_engine import build_engine

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16 if bf16 else torch.float32)
    return build_engine(model, lr=1e-6, warmup_steps=0, grad_accum_steps=grad_accum_steps, micro_batch_size=micro,
                        zero_stage=zero_stage, bf16=bf16, zero_tuning=zero_tuning(STAPOConfig()))


def run_config(config, seqs: dict, warm: dict, layout: Layout, zero_stage: int, work: dict, attn: str) -> dict:
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = work["sequences"] // work["minibatches"]
    engine = _build_engine(config, zero_stage, math.ceil(rows / layout.micro_batch_size), layout.micro_batch_size,
                           bf16=cuda)
    run_phases(engine, warm, layout, 1, attn, sync)  # warm-up: kernels, allocator, ZeRO-3 traces
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = run_phases(engine, seqs, layout, work["minibatches"], attn, sync)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    engine.destroy()
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"layout": layout.name, "cut": layout.cut, "zero": zero_stage, **times, "peak_gib": peak_gib}


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def report(rows: list[dict], tokens: int, flops: float, peak: float | None) -> str:
    """Markdown table; speed-ups are step-time ratios (stats + update). ``flops``: forward FLOPs of
    one pass over the batch (both phases make one)."""
    for r in rows:
        r["step_s"] = r["stats_s"] + r["update_s"]
        r.update(phase_throughput("stats", tokens, r["stats_s"], flops, peak, backward=False))
        r.update(phase_throughput("update", tokens, r["update_s"], flops, peak, backward=True))
    base = {r["zero"]: r["step_s"] for r in rows if r["layout"] == "padded"}
    low = min(base, default=None)  # the lowest ZeRO stage run: the one-GPU setting
    lines = ["| layout | micro-batch | ZeRO | stats s | stats tok/s | stats MFU | update s | update tok/s "
             f"| update MFU | update micro-batches | peak GiB | step s | × vs padded (same ZeRO) | × vs padded ZeRO-{low} |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        same, zero0 = base.get(r["zero"]), base.get(low)
        lines.append(
            f"| {r['layout']} | {r['cut']} | {r['zero']} | {r['stats_s']:.2f} | {r['tokens_per_s_stats']:,.0f} "
            f"| {_fmt(r.get('mfu_stats'), '.1%')} | {r['update_s']:.2f} | {r['tokens_per_s_update']:,.0f} "
            f"| {_fmt(r.get('mfu_update'), '.1%')} | {r['micro_batches']:.0f} | {_fmt(r['peak_gib'], '.1f')} "
            f"| {r['step_s']:.2f} | {_fmt(same and same / r['step_s'], '.2f')} "
            f"| {_fmt(zero0 and zero0 / r['step_s'], '.2f')} |")
    ratios = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        steps = {r["zero"]: r["step_s"] for r in rows if r["layout"] == layout}
        if low in steps and 3 in steps and low != 3:
            ratios.append(f"{layout} {steps[3] / steps[low]:.2f}×")
    if ratios:
        lines += ["", f"ZeRO-3 / ZeRO-{low} step time: " + ", ".join(ratios)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (seconds)")
    ap.add_argument("--vocab", type=int, default=VOCAB_SIZE, help="vocabulary size (default: the tiny tokenizer's)")
    ap.add_argument("--micro", type=int, help="rows per micro-batch of the padded layout (default 8)")
    ap.add_argument("--budget", type=int, help="token budget of a packed update micro-batch (default 16384)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa, flash_attention_2, flex_attention")
    ap.add_argument("--zero", default="1,3", help="ZeRO stages to compare, e.g. 1,3 (bf16 refuses 0)")
    ap.add_argument("--layouts", default="padded,packed")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    from transformers import Qwen3Config

    from stapo.distributed.process_group import init_distributed

    shape = "smoke" if args.smoke else "qwen3_0p6b"
    work = dict(WORKLOADS[shape], **{k: v for k, v in (("micro", args.micro), ("budget", args.budget)) if v})
    config = Qwen3Config(vocab_size=args.vocab, tie_word_embeddings=True, attn_implementation=args.attn,
                         **SHAPES[shape])
    init_distributed()
    seqs = synthetic_batch(work["sequences"], work["group"], work["prompt"], work["response"], args.vocab)
    warm_rows = work["sequences"] // work["minibatches"]
    warm = {k: v[:warm_rows] for k, v in seqs.items()}  # the first mini-batch's rows
    layouts = {"padded": Layout("padded", False, work["micro"], None),
               "packed": Layout("packed", True, work["micro"], work["budget"])}
    rows = [run_config(config, seqs, warm, layouts[name], int(z), work, args.attn)
            for name in args.layouts.split(",") for z in args.zero.split(",")]
    tokens = sum(seqs["lengths"])
    pairs = causal_context_length(seqs["lengths"]) * tokens
    flops = forward_flops(config, tokens, pairs, head_tokens=float(seqs["response_mask"].sum()))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    peak = device_peak_flops(device)
    print(f"\nGPU step phases, {shape} shape (vocab {args.vocab}, {args.attn}), {work['sequences']} sequences, "
          f"{tokens:,} real tokens, {work['minibatches']} mini-batches; device: {device or 'CPU'}"
          + (f" (peak {peak / 1e12:.1f} TFLOP/s bf16 dense)" if peak else " (no peak known: MFU blank)") + "\n")
    print(report(rows, tokens, flops, peak))
    if args.json:
        args.json.write_text(json.dumps({"tokens": tokens, "forward_flops": flops, "peak": peak, "rows": rows},
                                        indent=2))
    return rows


if __name__ == "__main__":
    main()
