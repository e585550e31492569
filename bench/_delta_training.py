"""Phase one of bench/weight_sync_delta.py: real AdamW steps on a Qwen3-shaped policy, and the weights rollout
servers would receive after each: the fp32 weights rounded to the servers' dtype (bf16: what DeepSpeed's bf16
training sends, from its fp32 master weights), saved as the first state and then each step's changed elements.

AdamW (torch.optim.AdamW, one per parameter) steps inside the backward pass from a post-accumulate-grad hook,
so the gradients never all exist at once: memory is the fp32 weights and AdamW's two moments, 12 bytes a
parameter. Inputs are random token ids (a language-model loss): AdamW normalises the step size, so the size of
an update is ~lr whatever the data. Per step it also records, from the real update, the changed fraction
expected once the fp32 weights no longer sit on the servers' grid (a run long underway): an element whose fp32
value lies anywhere in its rounding interval changes with probability min(1, |update| / spacing).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

KINDS = ("embed", "attention", "mlp", "norm")


def kind_of(name: str) -> str:
    if "embed" in name or "lm_head" in name:
        return "embed"
    if "norm" in name:
        return "norm"
    return "attention" if "self_attn" in name else "mlp"


def spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring ``dtype`` values at ``values`` (2**(e - 1) * eps for |v| in
    [2**(e-1), 2**e)); the smallest subnormal at 0."""
    _, exponent = torch.frexp(values.float())
    out = torch.ldexp(torch.full_like(values, torch.finfo(dtype).eps, dtype=torch.float32), exponent - 1)
    return torch.where(values == 0, torch.full_like(out, torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps),
                       out)


class Recorder:
    """The post-accumulate-grad hook of every parameter: step its AdamW, record what changed in ``dtype``."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, lr: float) -> None:
        self.dtype, self.changes, self.counts = dtype, {}, {}
        self._word = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
        for name, param in model.named_parameters():
            optimizer = torch.optim.AdamW([param], lr=lr, betas=(0.9, 0.999), weight_decay=0.01, foreach=False)
            param.register_post_accumulate_grad_hook(self._hook(name, optimizer))

    def _hook(self, name: str, optimizer):
        def step(param: torch.Tensor) -> None:
            before = param.detach().clone()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after = param.detach()
            old, new = before.to(self.dtype).view(-1), after.to(self.dtype).view(-1)
            changed = torch.ne(old.view(self._word), new.view(self._word)).nonzero().squeeze(1)
            self.changes[name] = (changed.int(), new[changed].clone())
            expected = (after - before).abs().view(-1).div(spacing(new, self.dtype)).clamp(max=1.0).sum()
            counts = self.counts.setdefault(kind_of(name), [0, 0, 0.0])  # changed, elements, expected
            counts[0] += changed.numel()
            counts[1] += new.numel()
            counts[2] += float(expected)
        return step


def train_and_record(config, dtype: torch.dtype, steps: int, lr: float, tokens: int, out: Path,
                     device: str = "cpu", seed: int = 0) -> list[dict]:
    """Save ``out/step_0.pt`` (the weights in ``dtype``) and ``out/step_<t>.pt`` (what changed) for ``steps``
    AdamW steps; returns per step the changed fraction (measured, and expected at steady state) per kind."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(device)  # fp32; HF's init: normal(0, 0.02), norms 1
    with torch.no_grad():  # start where a checkpoint in the servers' dtype puts the fp32 weights: on its grid
        for param in model.parameters():
            param.copy_(param.to(dtype))
    torch.save({n: p.detach().to(dtype).cpu() for n, p in model.named_parameters()}, out / "step_0.pt")
    recorder = Recorder(model, dtype, lr)
    rows = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        recorder.changes, recorder.counts = {}, {}
        ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed + step))
        model(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()  # AdamW steps in the hooks
        torch.save({n: (pos.cpu(), val.cpu()) for n, (pos, val) in recorder.changes.items()}, out / f"step_{step}.pt")
        total = [sum(c[i] for c in recorder.counts.values()) for i in range(3)]
        rows.append({"step": step, "seconds": time.perf_counter() - start, "changed_frac": total[0] / total[1],
                     "expected_frac": total[2] / total[1],
                     **{f"{k}_frac": recorder.counts[k][0] / recorder.counts[k][1] for k in KINDS if k in recorder.counts}})
    return rows
