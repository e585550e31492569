"""The lm_head's log-prob/entropy op on CUDA: logits GEMM on 16-bit tensor cores vs in fp32 (docs/benchmarks.md).

    python bench/head_gemm.py                      # Qwen3-0.6B and 1.7B hidden sizes, V=151,936, 32,768 tokens
    python bench/head_gemm.py --tokens 8192 --hidden 1024

``stapo.losses.token_logprobs_and_entropy`` computes the logits of bf16/fp16 hidden states and head weights on
CUDA with a 16-bit GEMM that writes fp32 (exact products, fp32 accumulation); before, it upcast both and ran
an fp32 GEMM. This times both on the same inputs (no-grad as in the statistics pass; forward + backward to the
hidden states and the weight as in the update) and gives each path's largest log-prob and entropy error
against an fp64 computation on the same 16-bit values. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.losses import ops  # noqa: E402

VOCAB = 151_936


def fp64_reference(hidden, weight, labels, temperature):
    """``(logprobs, entropy)`` in fp64 from the same 16-bit values, a token chunk at a time."""
    w = weight.double()
    out_lp, out_ent = [], []
    for start in range(0, hidden.shape[0], 256):
        logp = torch.log_softmax(hidden[start:start + 256].double() @ w.t() / temperature, dim=-1)
        out_lp.append(logp.gather(1, labels[start:start + 256, None]).squeeze(1))
        out_ent.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out_lp), torch.cat(out_ent)


def inputs(tokens: int, hidden_size: int, seed: int = 0):
    """Head-like inputs: RMS-normed hidden states, weights giving logits of std ~3, labels drawn from the
    model's own distribution (mostly likely tokens, as in sampled responses)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(VOCAB, hidden_size, device="cuda", generator=gen) * 3 / hidden_size**0.5).bfloat16()
    with torch.no_grad():
        labels = torch.cat([torch.multinomial(torch.softmax(hidden[s:s + 1024].float() @ weight.float().t(), -1), 1,
                                              generator=gen).squeeze(1) for s in range(0, tokens, 1024)])
    return hidden, weight, labels


def timed(fn) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(tokens: int, hidden_size: int, temperature: float, check_tokens: int) -> list[dict]:
    hidden, weight, labels = inputs(tokens, hidden_size)
    ref_lp, ref_ent = fp64_reference(hidden[:check_tokens], weight, labels[:check_tokens], temperature)

    def no_grad():
        with torch.no_grad():
            return ops.token_logprobs_and_entropy(hidden, weight, labels, temperature)

    def update():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logprobs, _ = ops.token_logprobs_and_entropy(h, w, labels, temperature)
        logprobs.sum().backward()

    rows = []
    for path, sixteen in (("fp32 GEMM", False), ("16-bit GEMM, fp32 out", True)):
        with mock.patch.object(ops, "_exact_16bit_gemm", lambda h, w, on=sixteen: on):
            with torch.no_grad():
                lp, ent = ops.token_logprobs_and_entropy(hidden[:check_tokens], weight, labels[:check_tokens],
                                                         temperature)
            rows.append({"hidden": hidden_size, "tokens": tokens, "temperature": temperature, "path": path,
                         "no_grad_s": timed(no_grad), "update_s": timed(update),
                         "logprob_err": (lp.double() - ref_lp).abs().max().item(),
                         "entropy_err": (ent.double() - ref_ent).abs().max().item()})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--check-tokens", type=int, default=2048, help="tokens compared with fp64")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/head_gemm.py needs a CUDA GPU: on CPU both paths are the fp32 GEMM", file=sys.stderr)
        return 2
    rows = [r for h in args.hidden for r in measure(args.tokens, h, args.temperature, args.check_tokens)]
    print(f"lm_head op on {torch.cuda.get_device_name()}, V={VOCAB:,}, {args.tokens:,} tokens, "
          f"T={args.temperature}\n")
    print("| hidden | logits GEMM | no-grad s | fwd+bwd s | × fwd+bwd vs fp32 | max abs logprob err vs fp64 "
          "| max abs entropy err |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next(b for b in rows if b["hidden"] == r["hidden"] and b["path"] == "fp32 GEMM")
        print(f"| {r['hidden']} | {r['path']} | {r['no_grad_s']:.3f} | {r['update_s']:.3f} | "
              f"{base['update_s'] / r['update_s']:.2f} | {r['logprob_err']:.2e} | {r['entropy_err']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
