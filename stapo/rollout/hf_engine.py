"""`HFEngine`: KV-cached batched sampling with a plain transformers model (CPU by default, GPU works).

Why our own decoding loop instead of `model.generate`: the trainer needs the log-probability of each
sampled token under the exact distribution it was drawn from (temperature → top-k → top-p,
renormalized; see `stapo.rollout.sampling`), reproducible from `SamplingParams.seed` with a private
`torch.Generator`. The loop prefills each prompt once, copies its KV cache to its G samples, and drops
finished rows from the batch so long-tail responses do not pay for short ones.

Usage (the engine owns its weights; the trainer pushes new ones every iteration):

    engine = HFEngine("path/to/model")            # loads its own copy (safe under ZeRO-3)
    rollout = engine.generate(prompt_ids, n=8, sampling=SamplingParams(seed=0))
    engine.load_weights(bucket)                   # [(hf_name, full_tensor), ...], bucket by bucket
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from stapo.rollout.batch import Rollout, left_pad
from stapo.rollout.engine import check_prompts
from stapo.rollout.sampling import SamplingParams, processed_logprobs, sample_from_logprobs, sample_rows

__all__ = ["HFEngine"]

logger = logging.getLogger("stapo.rollout")


class HFEngine:
    """A transformers causal LM held for inference, separate from the training copy.

    Args:
        model: a model directory / hub name (loaded here: the engine's own copy) or a
            `PreTrainedModel` (used as given, moved to `device` / `dtype`; pass a separate instance
            from the one being trained).
        tokenizer: tokenizer or its path; default: loaded from the model's directory.
        device: where the model runs; the returned `Rollout` is always on CPU.
        dtype: model dtype (sampling math is always fp32).
        max_batch_size: most rows (prompts × samples) decoded at once; larger requests are chunked.
    """

    def __init__(self, model, tokenizer=None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 64) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        if isinstance(model, (str, Path)):
            source = str(model)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
            model.requires_grad_(False)
        elif isinstance(model, PreTrainedModel):
            source = model.name_or_path
        else:
            raise TypeError(f"HFEngine model must be a path or a PreTrainedModel, got {type(model).__name__}")
        self.model = model.to(device=self.device, dtype=dtype).eval()
        if tokenizer is None:
            if not source or not Path(source).is_dir():
                raise ValueError("HFEngine needs tokenizer= when the model does not come from a local directory")
            tokenizer = source
        if isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_token_id = _pad_token_id(tokenizer, model, self.eos_token_ids)
        self._targets: dict[str, torch.Tensor] | None = None

    # ---------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """Sample `n` responses per prompt; see `Rollout` for the layout (rows grouped per prompt)."""
        prompts = check_prompts(prompt_ids, n)
        generator = self._generators(sampling, n, len(prompts))
        stop_ids = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        per_chunk = max(1, self.max_batch_size // n)
        rows = lambda i: generator[i * n: (i + per_chunk) * n] if isinstance(generator, list) else generator  # noqa: E731
        parts = [self._generate_chunk(prompts[i: i + per_chunk], n, sampling, stop_ids, rows(i))
                 for i in range(0, len(prompts), per_chunk)]
        return parts[0] if len(parts) == 1 else Rollout.concat(parts)

    def _generators(self, sampling: SamplingParams, n: int, num_prompts: int):
        """One generator for the call (``seed``), or one per row (``request_seeds``: prompt p's sample i
        draws from ``request_seeds[p] + i``, as vLLM seeds its n samples)."""
        if sampling.request_seeds is None:
            generator = torch.Generator(device=self.device)
            if sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(sampling.seed)
            return generator
        if len(sampling.request_seeds) != num_prompts:
            raise ValueError(f"SamplingParams.request_seeds has {len(sampling.request_seeds)} seeds for "
                             f"{num_prompts} prompts")
        return [torch.Generator(device=self.device).manual_seed(seed + i)
                for seed in sampling.request_seeds for i in range(n)]

    def _generate_chunk(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                        stop_ids: list[int], generator: torch.Generator | list[torch.Generator]) -> Rollout:
        from transformers import DynamicCache

        dev, pad = self.device, self.pad_token_id
        prompt_ids, prompt_mask = left_pad(prompts, pad)  # (P, Lp)
        attn = prompt_mask.long().to(dev)  # (P, Lp)
        positions = (attn.cumsum(dim=1) - 1).clamp(min=0)  # (P, Lp): 0 at each first real token
        cache = DynamicCache(config=self.model.config)
        cache_kw = cache_argument(self.model)
        out = self.model(input_ids=prompt_ids.to(dev), attention_mask=attn, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        # Prefill once per prompt, then give each of its n samples a copy of the cache.
        cache = getattr(out, cache_kw)
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # (B, V)
        attn = attn.repeat_interleave(n, dim=0)  # (B, Lp)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1  # (B, 1)

        b, t_max = logits.shape[0], sampling.max_new_tokens
        response = torch.full((b, t_max), pad, dtype=torch.long, device=dev)  # (B, T)
        logprobs = torch.zeros((b, t_max), dtype=torch.float32, device=dev)  # (B, T)
        valid = torch.zeros((b, t_max), dtype=torch.bool, device=dev)  # (B, T)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)  # (B,)
        rows = torch.arange(b, device=dev)  # (A,) rows still decoding
        stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
        steps = 0
        for step in range(t_max):
            dist = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # (A, V)
            if isinstance(generator, list):  # per-request seeds
                tokens, token_lp = sample_rows(dist, [generator[r] for r in rows.tolist()], sampling.greedy)
            else:
                tokens, token_lp = sample_from_logprobs(dist, generator, greedy=sampling.greedy)  # (A,)
            response[rows, step], logprobs[rows, step], valid[rows, step] = tokens, token_lp, True
            steps = step + 1
            done = torch.isin(tokens, stop)  # (A,)
            if sampling.stop:
                done |= self._stop_strings_hit(response, rows, step, sampling.stop)
            stopped[rows[done]] = True
            if step + 1 == t_max or bool(done.all()):
                break
            if bool(done.any()):  # drop finished rows from the batch and the cache
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tokens, attn, next_pos = rows[keep], tokens[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)  # (A, Lp+step+1)
            logits = self.model(input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos,
                                use_cache=True, **{cache_kw: cache}).logits[:, -1]  # (A, V)
            next_pos = next_pos + 1
        response, logprobs, valid = response[:, :steps].cpu(), logprobs[:, :steps].cpu(), valid[:, :steps].cpu()
        texts = self.tokenizer.batch_decode([r[m].tolist() for r, m in zip(response, valid, strict=True)],
                                            skip_special_tokens=True)
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0), prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            response_ids=response, response_mask=valid, sampling_logprobs=logprobs,
            finish_reason=["stop" if s else "length" for s in stopped.tolist()], response_text=texts,
            group_index=torch.arange(len(prompts)).repeat_interleave(n), group_size=n, pad_token_id=pad)

    def _stop_strings_hit(self, response: torch.Tensor, rows: torch.Tensor, step: int,
                          stop: tuple[str, ...]) -> torch.Tensor:
        """(A,) bool: rows whose decoded text (special tokens skipped, as vLLM checks ``stop``) now holds
        a stop string. Checked after every token, so the first hit is the token that completed it; the
        window of recent tokens is wide enough for the longest string (each token adds >= 1 character
        unless it is special or an incomplete UTF-8 byte)."""
        window = max(len(t) for t in stop) + 4
        tails = response[rows, max(0, step + 1 - window): step + 1].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(t in text for t in stop) for text in texts], dtype=torch.bool, device=rows.device)

    # ------------------------------------------------------------ weight sync
    def weight_update(self) -> contextlib.AbstractContextManager:
        """A sync session; nothing to set up: `load_weights` copies each tensor as it arrives."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full tensors (HF names) into the model; tied aliases (e.g.
        `lm_head.weight` ↔ `model.embed_tokens.weight`) share storage, so either name works.

        The whole bucket is checked (names, shapes) before anything is copied."""
        targets = self._named_targets()
        bucket = list(weights)
        unknown = [name for name, _ in bucket if name not in targets]
        if unknown:
            raise KeyError(f"HFEngine.load_weights: unknown parameter name(s) {unknown[:5]}"
                           f"{' ...' if len(unknown) > 5 else ''}; the model has e.g. {list(targets)[:3]}")
        for name, tensor in bucket:
            if tuple(tensor.shape) != tuple(targets[name].shape):
                raise ValueError(f"HFEngine.load_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(targets[name].shape)}")
        for name, tensor in bucket:
            targets[name].copy_(tensor.detach().to(device=targets[name].device, dtype=targets[name].dtype))

    def _named_targets(self) -> dict[str, torch.Tensor]:
        if self._targets is None:
            named = dict(self.model.named_parameters(remove_duplicate=False))
            named.update(self.model.named_buffers(remove_duplicate=False))
            self._targets = {name: t.data for name, t in named.items()}
        return self._targets

    # ------------------------------------------------------------ memory
    def sleep(self) -> None:
        """On CUDA, move the weights to CPU and free the cache; no-op on CPU."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            self._targets = None
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Move the weights back to the engine's device (no-op on CPU)."""
        if self.device.type == "cuda":
            self.model.to(self.device)
            self._targets = None


def _eos_token_ids(tokenizer, generation_config) -> list[int]:
    """EOS ids from the tokenizer and the generation config (either may hold a list)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        logger.warning("no EOS token id found: rows end only at max_new_tokens or stop_token_ids")
    return sorted(ids)


def _pad_token_id(tokenizer, model, eos_ids: list[int]) -> int:
    for value in (getattr(tokenizer, "pad_token_id", None),
                  getattr(getattr(model, "generation_config", None), "pad_token_id", None),
                  getattr(model.config, "pad_token_id", None)):
        if isinstance(value, int):
            return value
    return eos_ids[0] if eos_ids else 0


def cache_argument(model) -> str:
    """The KV-cache keyword of ``model.forward`` (and attribute of its output): ``cache`` in current
    transformers, ``past_key_values`` (deprecated there, with a FutureWarning each call) before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
