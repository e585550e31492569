"""Benchmark: one training step's GPU phases by layout, attention kernel and ZeRO stage, with the lm_head's share.

A Qwen3-0.6B- or 1.7B-shaped policy (``--shape``; random weights from ``transformers.Qwen3Config``, no hub
download) with Qwen3's 151,936-token vocabulary (``--vocab`` to change it) on a synthetic RL batch: 512
sequences in groups of G = 8, prompts of 48-64 tokens, responses of 0.2-1.0 x 512 tokens (uniform), random
token ids, advantages +1/-1 (half of each group). Times, for each configuration, the no-grad stats pass over
the whole batch and the update over 4 mini-batches (mask ``stapo``, clipped surrogate, backward, optimizer
step), after one warm-up of each (the stats pass's on the whole batch):

* ``padded``: rows padded to the longest, ``--micro`` (8) rows per micro-batch — the path before packing;
* ``packed``: padding-free packed rows, micro-batches cut by a ``--budget`` token budget (the stats
  pass takes twice the budget); with flash/flex attention a micro-batch is ONE row;

for each ``--attn`` (``auto`` resolved as the trainer resolves ``model.attn_implementation``) under
ZeRO-1 (the one-GPU setting: bf16 needs stage >= 1 for fp32 gradient accumulation) and ZeRO-3 (the
project's ``build_engine`` with the ``zero:`` defaults, in a 1-rank process group). The lm_head's chunked
log-prob/entropy op is also timed alone on the batch's response tokens (no-grad, and forward + backward),
which gives its share of each phase; its share of the model FLOPs comes from the config
(``--flops`` prints it for both shapes and exits). A configuration that runs out of memory is a row
saying so; the JSON (``--json``) is rewritten after every configuration, so a run cut short keeps its rows.

    python bench/gpu_step.py                                # 0.6B shape, real vocabulary, sdpa vs auto
    python bench/gpu_step.py --shape qwen3_1p7b --layouts packed --attn sdpa,auto
    python bench/gpu_step.py --flops                        # the head's FLOP share, analytically (CPU)
    python bench/gpu_step.py --smoke                        # 2 layers, width 64, 16 sequences, vocab 384: CPU
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

from _gpu_step_report import flops_table, head_flop_shares, report
from stapo.distributed.attention import ONE_ROW_ATTENTION, choose_attention
from stapo.telemetry.mfu import causal_context_length, device_peak_flops, forward_flops
from stapo.tiny.tokenizer import VOCAB_SIZE

QWEN3_VOCAB = 151_936
SHAPES = {
    "qwen3_0p6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3_1p7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
}
# sequences, G, prompt length range, max response, mini-batches, rows per micro-batch, token budget
FULL = dict(sequences=512, group=8, prompt=(48, 64), response=512, minibatches=4, micro=8, budget=16384)
SMOKE = dict(sequences=16, group=8, prompt=(6, 8), response=24, minibatches=4, micro=2, budget=64)
CHUNK = 128  # the head's token chunk (loss.chunk_size's default)


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


def run_phases(engine, seqs: dict, layout: Layout, minibatches: int, attn: str, sync) -> tuple[dict, torch.Tensor]:
    """The ONE place that calls the trainer's update API: stats pass, then ``minibatches`` updates (0: the
    stats pass only).

    Returns seconds per phase and the update's micro-batch count, and the stats pass's logprobs.
    """
    from stapo.losses import TokenStats, build_mask
    from stapo.trainer.update import TrainBatch, UpdateOptions, policy_stats, update_minibatch

    opts = UpdateOptions(packing=layout.packing, pack_one_row=layout.packing and attn in ONE_ROW_ATTENTION,
                         micro_batch_size=layout.micro_batch_size, max_tokens_per_micro_batch=layout.max_tokens,
                         max_tokens_per_stats_micro_batch=None, temperature=1.0, chunk_size=CHUNK)
    parts = {k: seqs[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages")}
    zeros = torch.zeros(seqs["response_ids"].shape)
    model, mask = engine.module, build_mask("stapo")
    sync()
    start = time.perf_counter()
    logprobs, entropy = policy_stats(model, TrainBatch(**parts, old_logprobs=zeros, old_entropy=zeros), opts)
    sync()
    stats_s = time.perf_counter() - start
    batch = TrainBatch(**parts, old_logprobs=logprobs, old_entropy=entropy)
    rows = len(batch) // max(minibatches, 1)
    micro_batches = 0.0
    start = time.perf_counter()
    for i in range(minibatches):
        part = batch.rows(slice(i * rows, (i + 1) * rows))
        keep = mask.apply(TokenStats(part.old_logprobs, part.old_entropy, part.advantages, part.response_mask)).keep
        sums = update_minibatch(engine, model, part, keep, opts)
        micro_batches += float(sums.get("micro_batches", float("nan")))
    sync()
    return {"stats_s": stats_s, "update_s": time.perf_counter() - start, "micro_batches": micro_batches}, logprobs


def head_seconds(config, response_tokens: int, device, dtype, sync) -> dict[str, float]:
    """The lm_head's chunked log-prob/entropy op alone (``stapo.losses.token_logprobs_and_entropy``, what both
    phases run at the response positions) on ``response_tokens`` hidden states: no-grad, and forward + backward
    (hidden and weight gradients, as in the update), each after a one-chunk warm-up."""
    from stapo.losses import token_logprobs_and_entropy

    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(response_tokens, config.hidden_size, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype, generator=gen) * 0.02
    labels = torch.randint(0, config.vocab_size, (response_tokens,), device=device, generator=gen)
    out = {}
    for phase, grad in (("stats", False), ("update", True)):
        h, w = hidden.detach().requires_grad_(grad), weight.detach().requires_grad_(grad)
        for n in (CHUNK, response_tokens):  # warm-up, then timed
            sync()
            start = time.perf_counter()
            with torch.set_grad_enabled(grad):
                logprobs, _ = token_logprobs_and_entropy(h[:n], w, labels[:n], chunk_size=CHUNK)
                if grad:
                    logprobs.sum().backward()
            sync()
        out[f"head_{phase}_s"] = time.perf_counter() - start
    return out


def build_engine(config, zero_stage: int, grad_accum_steps: int, micro: int, bf16: bool, **knobs):
    """The project's DeepSpeed engine around a seeded random model; ``knobs``: build_engine's
    ``gradient_checkpointing`` / ``compile_layers``."""
    from transformers import Qwen3ForCausalLM

    from stapo.config import STAPOConfig
    from stapo.trainer.components import zero_tuning
    from stapo.distributed import deepspeed_engine

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16 if bf16 else torch.float32)
    return deepspeed_engine.build_engine(model, lr=1e-6, warmup_steps=0, grad_accum_steps=grad_accum_steps,
                                         micro_batch_size=micro, zero_stage=zero_stage, bf16=bf16,
                                         zero_tuning=zero_tuning(STAPOConfig()), **knobs)


def run_config(config, seqs: dict, warm: dict, layout: Layout, zero_stage: int, work: dict, attn: str) -> dict:
    """One configuration's row; a configuration that runs out of GPU memory is a row saying so."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = work["sequences"] // work["minibatches"]
    row = {"layout": layout.name, "cut": layout.cut, "zero": zero_stage, "attn": attn}
    config._attn_implementation = attn  # the kernel this configuration's model is built with
    engine = None
    try:
        engine = build_engine(config, zero_stage, math.ceil(rows / layout.micro_batch_size), layout.micro_batch_size,
                               bf16=cuda)
        run_phases(engine, warm, layout, 1, attn, sync)  # warm-up: kernels, allocator, ZeRO-3 traces
        # and the stats pass at the timed pass's shapes: its packed rows differ from the warm-up's, and
        # flex_attention compiles per new shape (its stats pass was 1.48x sdpa's on an H200, its update 0.70x)
        run_phases(engine, seqs, layout, 0, attn, sync)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        row.update(run_phases(engine, seqs, layout, work["minibatches"], attn, sync)[0])
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
    finally:
        if engine is not None:
            engine.destroy()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (seconds)")
    ap.add_argument("--shape", default="qwen3_0p6b", choices=["qwen3_0p6b", "qwen3_1p7b"])
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: Qwen3's 151,936; --smoke: the tiny "
                    "tokenizer's 384)")
    ap.add_argument("--micro", type=int, help="rows per micro-batch of the padded layout (default 8)")
    ap.add_argument("--budget", type=int, help="token budget of a packed update micro-batch (default 16384)")
    ap.add_argument("--attn", default="sdpa,auto", help="attn_implementations to compare: auto, sdpa, "
                    "flash_attention_2, flex_attention (auto: as model.attn_implementation resolves it here)")
    ap.add_argument("--zero", default="1,3", help="ZeRO stages to compare, e.g. 1,3 (bf16 refuses 0)")
    ap.add_argument("--layouts", default="padded,packed")
    ap.add_argument("--flops", action="store_true", help="print the head's analytic FLOP share per shape and exit")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here (after every configuration)")
    args = ap.parse_args(argv)
    from transformers import Qwen3Config

    from stapo.distributed.process_group import init_distributed

    args.vocab = args.vocab or (VOCAB_SIZE if args.smoke else QWEN3_VOCAB)
    work = dict(SMOKE if args.smoke else FULL, **{k: v for k, v in (("micro", args.micro), ("budget", args.budget)) if v})
    seqs = synthetic_batch(work["sequences"], work["group"], work["prompt"], work["response"], args.vocab)
    if args.flops:
        print(flops_table({s: Qwen3Config(vocab_size=args.vocab, **SHAPES[s]) for s in ("qwen3_0p6b", "qwen3_1p7b")},
                          seqs))
        return []
    shape = "smoke" if args.smoke else args.shape
    config = Qwen3Config(vocab_size=args.vocab, tie_word_embeddings=True, **SHAPES[shape])
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    attns = list(dict.fromkeys(choose_attention(a, dtype=dtype) for a in args.attn.split(",")))
    init_distributed()
    warm_rows = work["sequences"] // work["minibatches"]
    warm = {k: v[:warm_rows] for k, v in seqs.items()}  # the first mini-batch's rows
    layouts = {"padded": Layout("padded", False, work["micro"], None),
               "packed": Layout("packed", True, work["micro"], work["budget"])}
    tokens, response_tokens = sum(seqs["lengths"]), int(seqs["response_mask"].sum())
    flops = forward_flops(config, tokens, causal_context_length(seqs["lengths"]) * tokens, head_tokens=response_tokens)
    device = torch.cuda.get_device_name() if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    data = {"shape": shape, "vocab": args.vocab, "device": device, "tokens": tokens, "response_tokens": response_tokens,
            "forward_flops": flops, "peak": device_peak_flops(device),
            **head_flop_shares(config, seqs["lengths"], response_tokens),
            **head_seconds(config, response_tokens, "cuda" if cuda else "cpu", dtype, sync), "rows": []}
    for attn in attns:
        for name in args.layouts.split(","):
            for zero in args.zero.split(","):
                data["rows"].append(run_config(config, seqs, warm, layouts[name], int(zero), work, attn))
                if args.json:
                    args.json.write_text(json.dumps(data, indent=2))
    print(f"\nGPU step phases, {shape} shape (vocab {args.vocab:,}; attention {', '.join(attns)}), {work['sequences']} "
          f"sequences, {tokens:,} real tokens ({response_tokens:,} response), {work['minibatches']} mini-batches; "
          f"device: {device or 'CPU'}" + (f" (peak {data['peak'] / 1e12:.1f} TFLOP/s bf16 dense)" if data["peak"]
                                          else " (no peak known: MFU blank)") + "\n")
    print(report(data))
    if args.json:  # again, with what the report derived (step seconds, tokens/s, MFU, the head's shares)
        args.json.write_text(json.dumps(data, indent=2))
    return data["rows"]


if __name__ == "__main__":
    main()
