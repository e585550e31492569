"""The lane's numeric bounds and the measurements behind them: bounds measured, not assumed.

vLLM's sampler log-probs and the trainer's teacher-forced recompute of the same tokens under the same weights
differ by the kernels alone (vLLM's oneDNN matmuls and own attention/norm kernels against torch's MKL SGEMM and
ATen kernels, each chosen by the CPU; tests/vllm_cpu/_machine.py), so the bound must hold on every CPU the lane
may draw and still catch a weight sync that did not land. Max |difference| per batch (fp32, the lane's warm
tiny Qwen3, 32 responses of <= 40 tokens, 725 tokens per batch, 4 seeds; vLLM 0.32 CPU, torch 2.13):

    CPU and kernel path                                                    max               mean
    AMD EPYC family 26 (Zen 5), AVX-512 + BF16, no AMX (oneDNN avx512)     3.9e-6 .. 7.7e-6  3e-7
      same CPU, ONEDNN_MAX_CPU_ISA=AVX2 (vLLM's matmuls: brg_matmul:avx2)  bit-identical
      same CPU, ATEN_CPU_CAPABILITY=avx2 (torch's ATen kernels on AVX2)    4.0e-6 .. 7.7e-6  3e-7
      same CPU, MKL_CBWR=COMPATIBLE (the trainer's SGEMM on MKL's
        compatible path, as MKL picks other code on other CPUs)            4.8e-6 .. 1.0e-5  3e-7
      same CPU, the three together, in the lane (its 11 numeric tests)     up to 1.1e-5
    Intel Xeon, AVX-512 + AMX (issue 45; per training step, 32 x 40
      tokens; the colocated engine and the servers alike)                  1.0e-5 .. 2.3e-5
    one H200, vLLM 0.26 (fp32 GPU kernels vs the CPU recompute)            up to 6.8e-4

A stale sync on the same batches (the sampler a random-sign step of 2e-4 per weight behind the trainer, Adam's
first step at the lane's lr): max 3.4e-2 .. 9.1e-2, mean 2.0e-3 .. 2.2e-3; one real AdamW step at that lr
(test_bounds.py, every run): max 2.6; an asynchronous run's batches one update behind: 4.3.

The whole lane on the EPYC (default kernels; the lane prints every figure at its end): training steps,
colocated and server alike, 5.5e-6 .. 6.4e-6 (equal row for row); 2 ranks / a TP-2 engine 1.4e-5; LoRA
1.1e-5; served teacher-forced log-probs after syncs <= 3.8e-6; tool episodes 5.0e-6.

The CPU bound, 1e-4, is 4x the largest CPU figure (the Xeon's), 10x the EPYC's on its worst path, and over
300x under a stale sync's max (20x under its mean): it holds on every CPU kind measured and still catches a
sync that did not land (test_bounds.py injects a CPU-like 3e-5 offset to show it). The old 1e-5 came from a
~1e-6 measured on one CPU. On a GPU, vLLM's logprobs depend on the batch a request ran in (docs/gpu.md): 2e-3,
3x its figure.
"""

from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()
FP32_LOGPROB_BOUND = 2e-3 if ON_GPU else 1e-4
STALE_SYNC_MIN = 1e-2  # the smallest max mismatch of a stale sync that the bound must catch (measured above)
# vLLM's log-probs of one request computed in two different batches (a server's and the colocated engine's, or
# a call alone and merged with others): measured max 3.1e-6 on the EPYC (0 for merged vs alone there); bounded
# by 3e-5, the CPU-like offset test_bounds.py injects. On a GPU they move in the 4th decimal: the GPU bound.
BATCH_NOISE = FP32_LOGPROB_BOUND if ON_GPU else 3e-5
# On identical samples the trainer's side is one computation, so the server path's figure is the colocated
# engine's up to that noise: within 2x + BATCH_NOISE (far tighter than the absolute bound where the colocated
# figure is small; a stale server fails it).
SERVER_FACTOR = 2.0

FIGURES: list[str] = []  # "what: figure" lines of the numeric checks, printed at the end of the lane


def report(what: str, value: float) -> None:
    FIGURES.append(f"{what}: {value:.3g}")


def assert_fp32_noise(mismatch: float, what: str, bound: float = FP32_LOGPROB_BOUND) -> None:
    """``mismatch`` (a max |sampler - trainer| log-prob) is the kernels' noise, not a sync that did not land."""
    from _machine import describe

    assert mismatch <= bound, (
        f"{what}: log-prob mismatch {mismatch:.3g} > {bound:g} (tests/vllm_cpu/_bounds.py; a stale sync "
        f"shows >= {STALE_SYNC_MIN:g}) on {describe()}")


def assert_steps_fp32_noise(steps: list[dict], what: str, bound: float = FP32_LOGPROB_BOUND) -> None:
    """Every training step's ``mismatch_logp_abs_max`` (metrics.jsonl) within ``bound``, each reported."""
    for row in steps:
        report(f"{what}, step {row['step']}: mismatch_logp_abs_max", row["mismatch_logp_abs_max"])
        assert_fp32_noise(row["mismatch_logp_abs_max"], f"{what}, step {row['step']}", bound)


def assert_like_colocated(server: float, colocated: float, what: str) -> None:
    """On identical samples the server path's mismatch is the colocated engine's: the path adds nothing."""
    assert server <= SERVER_FACTOR * colocated + BATCH_NOISE, (
        f"{what}: the server path's mismatch {server:.3g} exceeds {SERVER_FACTOR:g} x the colocated engine's "
        f"{colocated:.3g} + {BATCH_NOISE:g} on the same samples (tests/vllm_cpu/_bounds.py)")
