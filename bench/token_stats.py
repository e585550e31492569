"""Chunked vs naive token logprob + entropy: peak extra memory and wall time (docs/losses.md, docs/benchmarks.md).

    python bench/token_stats.py                    # V=151,936, H=1,024, N in {1024, 2048}
    python bench/token_stats.py --smoke            # tiny shapes, seconds (used by the tests)

Each (variant, N) runs in a FRESH subprocess on CPU. Measured: forward (logprobs + detached
entropy) + backward of ``sum(g * logprobs)`` to the hidden states; the lm_head weight does not
require grad (its own gradient costs the same on both paths). Peak extra memory = RSS
high-water (VmHWM, reset via /proc/self/clear_refs once inputs are allocated; falls back to
``resource.getrusage``) minus the RSS at that point.

naive   : logits = h @ W.T -> log_softmax -> gather, entropy = -(p * logp).sum(-1) (no grad)
chunked : stapo.losses.token_logprobs_and_entropy (token chunks, no (N, V) tensor)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(reset_ok: bool) -> int:
    if reset_ok:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _child(variant: str, n_tok: int, vocab: int, hidden_size: int, chunk: int, repeats: int, wgrad: bool) -> dict:
    import torch

    from stapo.losses import token_logprobs_and_entropy

    gen = torch.Generator().manual_seed(0)
    # in-place init: no transient copies that would raise the high-water mark before the baseline
    weight = torch.empty(vocab, hidden_size).normal_(std=hidden_size**-0.5, generator=gen)  # (V, H), frozen
    hidden = torch.empty(n_tok, hidden_size).normal_(generator=gen).requires_grad_()  # (N, H)
    weight.requires_grad_(wgrad)
    labels = torch.randint(0, vocab, (n_tok,), generator=gen)
    grad_out = torch.randn(n_tok, generator=gen)

    def step():
        hidden.grad = weight.grad = None
        if variant == "naive":
            logp = torch.log_softmax(hidden @ weight.T, dim=-1)  # (N, V)
            logprobs = logp.gather(1, labels[:, None]).squeeze(1)
            with torch.no_grad():
                entropy = -(logp.exp() * logp).sum(-1)
        else:
            logprobs, entropy = token_logprobs_and_entropy(hidden, weight, labels, chunk_size=chunk)
        (logprobs * grad_out).sum().backward()
        return entropy

    base = _rss_bytes()
    reset_ok = _reset_peak()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_extra_mb": (_peak_bytes(reset_ok) - base) / 2**20, "time_s": min(times), "times": times}


def _run_child(args, variant: str, n_tok: int) -> dict:
    cmd = [
        sys.executable, __file__, "--child", variant, "--tokens", str(n_tok), "--vocab", str(args.vocab),
        "--hidden", str(args.hidden), "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats),
    ] + (["--weight-grad"] if args.weight_grad else [])  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-size", type=int, default=None, help="default: the library default")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per subprocess (min is kept)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--weight-grad", action="store_true", help="also let the lm_head weight require grad")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes for a quick check")
    ap.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.chunk_size is None:
        from stapo.losses.ops import DEFAULT_CHUNK_SIZE

        args.chunk_size = DEFAULT_CHUNK_SIZE
    if args.child:
        res = _child(args.child, args.tokens[0], args.vocab, args.hidden, args.chunk_size, args.repeats, args.weight_grad)
        print(json.dumps(res))
        return ""
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.repeats = [64], 1000, 32, 1
    lines = [
        f"Token logprob+entropy, fwd+bwd to hidden, CPU fp32, V={args.vocab:,}, H={args.hidden:,}, "
        f"chunk={args.chunk_size}, lm_head grad={'yes' if args.weight_grad else 'no'}, "
        f"torch threads={os.environ.get('OMP_NUM_THREADS', 'default')}",
        "",
        "| N tokens | naive peak MB | chunked peak MB | mem ratio | naive s | chunked s | time ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n_tok in args.tokens:
        naive, chunked = _run_child(args, "naive", n_tok), _run_child(args, "chunked", n_tok)
        lines.append(
            f"| {n_tok:,} | {naive['peak_extra_mb']:.0f} | {chunked['peak_extra_mb']:.0f} | "
            f"{chunked['peak_extra_mb'] / max(naive['peak_extra_mb'], 1e-9):.3f} | {naive['time_s']:.2f} | "
            f"{chunked['time_s']:.2f} | {chunked['time_s'] / naive['time_s']:.3f} |"
        )
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
