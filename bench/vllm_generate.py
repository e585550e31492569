"""Benchmark: `stapo.rollout.generate` on a `VLLMEngine` vs plain `vllm.LLM.generate` on the same requests.

Both sides use the SAME `vllm.LLM` (the engine's own) and the same requests: one sample each with its own
seed (stapo's seed scheme; vLLM's seeded sampling is slower than unseeded), so the ratio is stapo's overhead
only: the driver's requests, the conversion of vLLM's outputs into segments and their assembly into a
`Rollout`. Runs alternate (plain, stapo, plain, ...) after a
warm-up; prints the median seconds of each and the ratio (issue #13 target: <= 1.2x).

    python bench/vllm_generate.py                          # builtin tiny model, 256 prompts x 8
    python bench/vllm_generate.py --model Qwen/Qwen3-0.6B --prompts 128 --max-tokens 1024

Needs a CUDA GPU and vLLM; exits with a message (status 2) without them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny", help="HF model dir/name, or builtin:tiny")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each side")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    return p.parse_args(argv)


def _unavailable() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm]')"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = _unavailable()
    if reason:
        print(f"bench/vllm_generate.py needs a CUDA GPU and vLLM: {reason}; nothing measured.", file=sys.stderr)
        return 2
    import torch
    import vllm

    from stapo.rollout import Generation, SamplingParams, VLLMEngine, generate
    from stapo.rollout.sampling import vllm_request_kwargs

    model = args.model
    if model == "builtin:tiny":
        from stapo.tiny import build_tiny_model

        model = str(build_tiny_model())
    engine = VLLMEngine(model, gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=False,
                        max_model_len=args.prompt_len + args.max_tokens)
    vocab = engine.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 1, (args.prompts, args.prompt_len), generator=gen).tolist()
    ours = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_tokens, seed=1234)
    segments = [t.request(args.max_tokens) for t in Generation(prompts, args.n, ours).trajectories]
    plain_params = [vllm.SamplingParams(**vllm_request_kwargs(ours), max_tokens=r.max_new_tokens, seed=r.seed)
                    for r in segments]
    requests = [{"prompt_token_ids": r.context} for r in segments]

    def run_plain() -> tuple[float, int]:
        start = time.perf_counter()
        outs = engine.llm.generate(requests, sampling_params=plain_params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(c.token_ids) for o in outs for c in o.outputs)

    def run_stapo() -> tuple[float, int]:
        start = time.perf_counter()
        rollout = generate(engine, prompts, args.n, ours)
        return time.perf_counter() - start, int(rollout.response_mask.sum())

    run_plain(), run_stapo()  # warm-up (CUDA graphs, allocator)
    times = {"plain vLLM": [], "VLLMEngine": []}
    tokens = {"plain vLLM": [], "VLLMEngine": []}
    for _ in range(args.repeats):
        for name, fn in (("plain vLLM", run_plain), ("VLLMEngine", run_stapo)):
            seconds, n_tokens = fn()
            times[name].append(seconds)
            tokens[name].append(n_tokens)
    print(f"| side | median s | tokens/s | ({args.prompts} prompts x {args.n}, <= {args.max_tokens} tokens, "
          "both: one seeded request per sample) |")
    print("|---|---|---|---|")
    for name in times:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.3f} | {statistics.median(tokens[name]) / med:,.0f} | |")
    ratio = statistics.median(times["VLLMEngine"]) / statistics.median(times["plain vLLM"])
    print(f"\nratio VLLMEngine / plain vLLM: {ratio:.3f}x (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
