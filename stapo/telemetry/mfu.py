"""Model FLOPs utilization (MFU) and tokens/s per training phase (docs/benchmarks.md).

Model FLOPs come from the transformers config, never a profiler, so padding, recomputation and ZeRO
communication show up as lower MFU. Attention counts ``S (S + 1) / 2`` causal pairs per sequence (PaLM's
appendix B counts ``S``), the lm_head only where it is applied; a gradient-checkpointing recompute is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, matched against ``torch.cuda.get_device_name()``
# (case-insensitive substring, FIRST match wins, so variants precede their family name):
# - H100 SXM 989.4e12, PCIe 756e12: NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table 1
#   (1,978.9 / 1,513 TFLOPS with sparsity); H100 NVL 835.5e12: https://www.nvidia.com/en-us/data-center/h100/
#   (1,671 TFLOPS with sparsity).
# - H200 SXM 989.4e12 (same GH100 tensor cores as H100 SXM), H200 NVL 835.5e12:
#   https://www.nvidia.com/en-us/data-center/h200/ (1,979 / 1,671 TFLOPS with sparsity). GH200's GPU is
#   an H100/H200 SXM (https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/).
# - A100 (SXM and PCIe) 312e12: NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/
#   (624 TFLOPS with sparsity).
# - B200 2.25e15: HGX B200, https://www.nvidia.com/en-us/data-center/hgx/ (36 PFLOPS FP16/BF16 with
#   sparsity for 8 GPUs = 4.5 per GPU, half dense). GB200 2.5e15: GB200 NVL72,
#   https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (360 PFLOPS sparse for 72 GPUs = 5 per GPU).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),
    ("H200 NVL", 835.5e12),
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("A100", 312e12),
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
)


def device_peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak FLOP/s of a ``torch.cuda.get_device_name()``; None on CPU or an unknown device (no MFU)."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in name:
            return flops
    return None


def _field(hf_config, name: str):
    value = getattr(hf_config, name, None)
    if value is None:
        raise ValueError(f"MFU: the model config ({type(hf_config).__name__}) has no {name!r}")
    return value


def matmul_params(hf_config) -> int:
    """Parameters that enter a matmul once per token (q/k/v/o with GQA, MLP, lm_head); MoE is refused."""
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None):
        raise ValueError(f"MFU: mixture-of-experts configs ({type(hf_config).__name__}) are not "
                         "supported (active parameters per token differ from the dense count)")
    hidden = _field(hf_config, "hidden_size")
    heads = _field(hf_config, "num_attention_heads")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o: heads; k and v: kv_heads
    mlp = 3 * hidden * _field(hf_config, "intermediate_size")  # gate, up, down
    return _field(hf_config, "num_hidden_layers") * (attention + mlp) + head_params(hf_config)


def head_params(hf_config) -> int:
    """Parameters of the lm_head matmul: ``hidden x vocab`` (a matmul even when tied to the embedding)."""
    return _field(hf_config, "hidden_size") * _field(hf_config, "vocab_size")


def forward_flops(hf_config, tokens: float, attn_pairs: float, head_tokens: float) -> float:
    """Forward FLOPs over ``tokens`` real tokens, ``attn_pairs`` attended pairs and ``head_tokens`` lm_head
    positions (module doc)."""
    if min(tokens, attn_pairs, head_tokens) < 0:
        raise ValueError(f"forward_flops: counts must be >= 0, got tokens={tokens}, attn_pairs={attn_pairs}, "
                         f"head_tokens={head_tokens}")
    heads = _field(hf_config, "num_attention_heads")
    head_dim = getattr(hf_config, "head_dim", None) or _field(hf_config, "hidden_size") // heads
    head = head_params(hf_config)
    attention = 2 * 2 * _field(hf_config, "num_hidden_layers") * heads * head_dim * attn_pairs
    return 2.0 * (matmul_params(hf_config) - head) * tokens + attention + 2.0 * head * head_tokens


def causal_context_length(sequence_lengths: Sequence[int]) -> float:
    """Mean keys attended per token over causal sequences of real lengths: ``Σ S(S+1)/2 / Σ S`` (0: none)."""
    total = sum(sequence_lengths)
    return sum(s * (s + 1) / 2 for s in sequence_lengths) / total if total else 0.0


def phase_throughput(phase: str, tokens: float, seconds: float, flops: float,
                     peak: float | None, backward: bool, devices: int = 1) -> dict[str, float]:
    """``{tokens_per_s_<phase>, mfu_<phase>}`` (MFU only with a known ``peak``) for ``tokens`` real tokens of
    forward FLOPs ``flops`` in ``seconds`` on ``devices`` devices; ``backward``: x3."""
    if seconds <= 0 or tokens < 0 or devices < 1:
        raise ValueError(f"phase_throughput({phase!r}): need seconds > 0, tokens >= 0 and devices >= 1, "
                         f"got seconds={seconds}, tokens={tokens}, devices={devices}")
    out = {f"tokens_per_s_{phase}": tokens / seconds}
    if peak:
        model_flops = flops * (3.0 if backward else 1.0)
        out[f"mfu_{phase}"] = model_flops / (seconds * peak * devices)
    return out
