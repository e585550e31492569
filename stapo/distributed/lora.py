"""LoRA adapters on the policy (PEFT): the one module that imports ``peft`` (docs/lora.md).

The algorithm is unchanged; the KL reference is the policy with its adapters off (:class:`DisabledAdapters`);
the weight sync merges ``W + scaling * B @ A`` under base-model names (:class:`AdapterMerge`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from stapo.distributed.flat_gather import gathered
from stapo.distributed.names import hf_name

#: Qwen3's attention and MLP projections: every linear layer of a decoder block.
QWEN3_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
BASE_LAYER = ".base_layer."  # a LoRA layer keeps the wrapped nn.Linear under this name

Bucket = list[tuple[str, torch.Tensor]]


def require_peft():
    """The ``peft`` module, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError("model.lora.enabled needs PEFT: pip install 'stapo[lora]' (or pip install peft)") from exc
    return peft


def wrap_with_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float,
                   target_modules: tuple[str, ...] | list[str], seed: int):
    """``model`` with LoRA adapters on ``target_modules``; ``A`` is drawn under ``seed`` in a forked RNG, so
    every rank builds identical adapters and the caller's RNG streams are untouched."""
    problem = lora_target_problem(model, target_modules)
    if problem is not None:
        raise ValueError(problem)
    peft = require_peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                             bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    wrapped.config.use_cache = False
    return wrapped


def lora_target_problem(model: torch.nn.Module, target_modules) -> str | None:
    """Why ``model.lora.target_modules`` does not fit ``model``: the names that match no module (PEFT fails
    only when none matches, so a misspelt one among good ones would silently train fewer adapters)."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return None
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return (f"model.lora.target_modules: {missing} name no module of this model; its linear layers: "
            f"{', '.join(linear)}")


def is_peft_model(model) -> bool:
    """True for a PEFT ``PeftModel`` (or a DeepSpeed engine wrapping one); never imports peft."""
    module = getattr(model, "module", model)
    return hasattr(module, "peft_config") and hasattr(module, "disable_adapter")


def plain_model(model) -> torch.nn.Module:
    """The transformers model inside a ``PeftModel``, ``model`` itself otherwise."""
    return model.get_base_model() if is_peft_model(model) else model


def base_name(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` → ``model.layers.0.q_proj.weight``."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(BASE_LAYER, ".")


class DisabledAdapters:
    """The reference policy of a LoRA run: the policy inside ``disable_adapter()`` (the frozen base model)."""

    def __init__(self, model) -> None:
        if not is_peft_model(model):
            raise TypeError(f"DisabledAdapters needs a PEFT model, got {type(model).__name__}")
        self.model = model

    @contextlib.contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        with self.model.disable_adapter():
            yield self.model


def reference_scope(reference) -> contextlib.AbstractContextManager:
    """``with reference_scope(ref) as module:`` the module to run the reference forward on."""
    return reference.active() if isinstance(reference, DisabledAdapters) else contextlib.nullcontext(reference)


@dataclass(frozen=True)
class AdapterPair:
    """The adapter of one base weight, by parameter name: ``delta = scaling * B @ A``."""

    lora_a: str  # (r, in)
    lora_b: str  # (out, r)
    scaling: float  # alpha / r (alpha / sqrt(r) with rsLoRA)


class AdapterMerge:
    """How the sync of a LoRA policy groups (a base weight with its adapter, in one gather) and merges
    (name, tensor) pairs; ``pairs``: base weight name (``hf_name``) -> its adapter."""

    def __init__(self, pairs: dict[str, AdapterPair]) -> None:
        self.pairs = pairs
        self._owner = {n: base for base, p in pairs.items() for n in (p.lora_a, p.lora_b)}

    @classmethod
    def of(cls, model: torch.nn.Module, name_fn) -> "AdapterMerge | None":
        """The merge plan of ``model``, None without LoRA layers; ``name_fn``: raw name -> the sync's name."""
        pairs = {}
        for prefix, module in model.named_modules():
            if not (hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")):
                continue
            if getattr(module, "disable_adapters", False):
                continue  # adapters off: the base weight is the policy's weight
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if len(adapters) != 1 or getattr(module, "merged", False) or getattr(module, "fan_in_fan_out", False) \
                    or module.use_dora.get(adapters[0], False):
                raise ValueError(f"{prefix}: weight sync merges exactly one active, unmerged, plain LoRA adapter "
                                 f"on a Linear layer (active: {adapters}, merged: {module.merged}; "
                                 "embeddings, DoRA and fan_in_fan_out layers are not supported)")
            name = adapters[0]
            pairs[name_fn(f"{prefix}.base_layer.weight")] = AdapterPair(
                name_fn(f"{prefix}.lora_A.{name}.weight"), name_fn(f"{prefix}.lora_B.{name}.weight"),
                float(module.scaling[name]))
        return cls(pairs) if pairs else None

    def units(self, names: list[str]) -> list[list[int]]:
        """Indices of ``names`` grouped so each base weight travels with its ``A`` and ``B``; order kept."""
        index = {n: i for i, n in enumerate(names)}
        missing = [n for p in self.pairs.values() for n in (p.lora_a, p.lora_b) if n not in index]
        if missing:
            raise KeyError(f"adapter parameters not among the model's parameters: {missing[:3]}")
        tied = [n for n in self.pairs if n not in index]  # named_parameters() lists a tied weight once
        if tied:
            raise ValueError(f"LoRA on a tied weight cannot be merged into one tensor: {tied[:3]} (leave "
                             "lm_head out of model.lora.target_modules when the embeddings are tied)")
        units: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            units.setdefault(self._owner.get(name, name), []).append(i)
        return list(units.values())

    def __call__(self, bucket: Bucket) -> Bucket:
        """Merged ``W + scaling * B @ A`` (computed in fp32, stored in W's dtype) under base names."""
        tensors = dict(bucket)
        out = []
        for name, tensor in bucket:
            if name in self._owner:
                continue
            pair = self.pairs.get(name)
            if pair is not None:
                a, b = tensors[pair.lora_a], tensors[pair.lora_b]
                tensor = torch.addmm(tensor.float(), b.float(), a.float(), alpha=pair.scaling).to(tensor.dtype)
            out.append((base_name(name), tensor))
        return out


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters' tensors on the CPU under PEFT's names; collective under ZeRO-3."""
    module = getattr(model, "module", model)
    named = [(n, p) for n, p in module.named_parameters() if ".lora_" in n]
    with gathered([p for _, p in named]):
        return {hf_name(n): p.detach().to("cpu", copy=True) for n, p in named}
