"""Benchmark: trainer-side memory and CPU step time, full fine-tuning vs LoRA (docs/lora.md).

Each variant runs in its own process (one CPU rank, the real ``build_engine``: DeepSpeed, ZeRO stage 0,
fp32, AdamW) on a random-init model with Qwen3-0.6B's shapes (hidden 1024, MLP 3072, 16/8 heads of
128, 151,936-token tied vocabulary) and, by default, 8 of its 28 decoder layers (RAM: full fine-tuning
of all 28 in fp32 needs ~10 GB before activations; ``--layers 28`` where the box has it). One update
is the trainer's: the chunked logprob op over a packed micro-batch of ``--tokens`` tokens, backward,
optimizer step; wall and CPU time (one thread: CPU time is stable on a loaded box). Memory is
MEASURED, not computed: the bytes of the distinct storages of the parameters, of the gradients right
after backward, and of the optimizer state after a step; plus the process's RSS growth from the built
model to after the last step, as a second witness.

    python bench/lora_memory.py                  # 8 layers, 256 tokens, 3 timed steps each
    python bench/lora_memory.py --layers 28      # the whole Qwen3-0.6B shape (needs ~12 GB free)
    python bench/lora_memory.py --smoke          # tiny shape, one step each: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _cpu_ranks import launch_cpu_ranks  # bench/ is on sys.path

MiB = 2**20
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
SMOKE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, tie_word_embeddings=True)


def _rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied or viewed tensors counted once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if hasattr(v, "untyped_storage") and v.dim() > 0)


def worker(variant: str, shape: dict, layers: int, tokens: int, steps: int, rank: int) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.distributed.lora import QWEN3_TARGET_MODULES, wrap_with_lora
    from stapo.distributed.policy import PackedInputs, response_token_stats

    init_distributed()
    torch.manual_seed(0)
    config = Qwen3Config(**shape, num_hidden_layers=layers, attn_implementation="sdpa", use_cache=False)
    model = Qwen3ForCausalLM(config).float()
    if variant == "lora":
        model = wrap_with_lora(model, rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=QWEN3_TARGET_MODULES,
                               seed=0)
    rss_model = _rss_bytes()
    engine = build_engine(model, lr=1e-5, warmup_steps=0, grad_accum_steps=1, zero_stage=0, bf16=False)
    prompt = torch.randint(0, shape["vocab_size"], (1, tokens // 4))
    response = torch.randint(0, shape["vocab_size"], (1, tokens - tokens // 4))
    inputs = PackedInputs.from_parts(prompt, torch.ones_like(prompt, dtype=torch.bool), response,
                                     torch.ones_like(response, dtype=torch.bool))
    times, cpu_times, grads = [], [], 0
    for _ in range(steps + 1):  # the first step is warm-up (allocations, lazy optimizer state)
        start, cpu_start = time.perf_counter(), time.process_time()
        logprobs, _ = response_token_stats(engine.module, inputs, temperature=1.0, chunk_size=128)
        engine.backward(-logprobs.mean())
        grads = _storage_bytes(p.grad for p in engine.module.parameters())
        engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    params = list(engine.module.parameters())
    return {
        "variant": variant if variant == "full" else f"lora r{rank}",
        "params_total": sum(p.numel() for p in params),
        "params_trainable": sum(p.numel() for p in params if p.requires_grad),
        "param_mib": _storage_bytes(params) / MiB,
        "grad_mib": grads / MiB,
        "optim_mib": _storage_bytes(_optimizer_tensors(engine.optimizer)) / MiB,
        "rss_growth_mib": (_rss_bytes() - rss_model) / MiB,
        "step_s": statistics.median(times[1:]),
        "step_cpu_s": statistics.median(cpu_times[1:]),  # one thread: stable on a loaded box
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the packed micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 1 step: checks that the script runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape, layers, tokens, steps = (SMOKE, 2, 16, 1) if args.smoke else (QWEN3_06B, args.layers, args.tokens,
                                                                          args.steps)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, shape, layers, tokens, steps, args.rank)), flush=True)
        return
    rows = []
    for variant in ("full", "lora"):  # one process each: RSS and allocator state are not shared
        rows += launch_cpu_ranks(__file__, [*sys.argv[1:], "--worker", variant], 1, timeout=3000, what=variant)
    what = "smoke shape" if args.smoke else f"Qwen3-0.6B shape, {layers} of 28 layers"
    print(f"Trainer memory and CPU step time: {what}, {tokens} tokens/step, ZeRO-0 fp32 AdamW.\n")
    print("| variant | params | trainable | params MiB | grads MiB | optimizer MiB | params+grads+optim MiB "
          "| RSS growth MiB | step s (wall) | step s (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        total = r["param_mib"] + r["grad_mib"] + r["optim_mib"]
        print(f"| {r['variant']} | {r['params_total']:,} | {r['params_trainable']:,} | {r['param_mib']:.1f} "
              f"| {r['grad_mib']:.1f} | {r['optim_mib']:.1f} | {total:.1f} | {r['rss_growth_mib']:.1f} "
              f"| {r['step_s']:.2f} | {r['step_cpu_s']:.2f} |")
    full, lora = rows
    ratio = (lora["param_mib"] + lora["grad_mib"] + lora["optim_mib"]) / (
        full["param_mib"] + full["grad_mib"] + full["optim_mib"])
    print(f"\nLoRA / full (params + grads + optimizer state): {ratio:.3f}")
    print(f"LoRA / full (optimizer state): {lora['optim_mib'] / full['optim_mib']:.4f}")


if __name__ == "__main__":
    main()
