"""`HFEngine`: KV-cached batched sampling with a plain transformers model (docs/rollout.md, "`HFEngine`").

Our own loop, not `model.generate`: the trainer needs each token's log-prob under the distribution it was drawn
from (`stapo.rollout.sampling`), reproducible from the request's seed whatever else is in the batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from stapo.rollout.batch import left_pad
from stapo.rollout.engine import RolloutEngine, Segment, SegmentRequest, eos_token_ids, pad_token_id
from stapo.rollout.sampling import SamplingParams, processed_logprobs, sample_with_uniforms
from stapo.sync.buckets import StateDictConsumer

__all__ = ["HFEngine"]

logger = logging.getLogger("stapo.rollout")

_DRAWS = 256  # uniforms drawn per request at a time (its generator's stream, in order)


class HFEngine(RolloutEngine):
    """A transformers causal LM held for inference, separate from the training copy (docs/rollout.md, "`HFEngine`").

    ``max_batch_size`` rows are decoded at once (more in chunks); sampling math is fp32 whatever ``dtype``.
    """

    def __init__(self, model, tokenizer=None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 64, progress: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size, self.progress = max_batch_size, progress
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
        generation_config = getattr(model, "generation_config", None)
        self.eos_token_ids = eos_token_ids(tokenizer, generation_config)
        if not self.eos_token_ids:
            logger.warning("no EOS token id found: rows end only at max_new_tokens or stop_token_ids")
        self.pad_token_id = pad_token_id(tokenizer, generation_config, model.config)

    # ---------------------------------------------------------------- generate
    @torch.no_grad()
    def generate_segments(self, requests: Sequence[SegmentRequest], sampling: SamplingParams) -> list[Segment]:
        """Decode every request, ``max_batch_size`` rows at a time (see the module docstring)."""
        stop_ids = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        out: list[Segment] = []
        for start in range(0, len(requests), self.max_batch_size):
            out += self._decode(list(requests[start: start + self.max_batch_size]), sampling, stop_ids)
            if self.progress:
                logger.info("HFEngine: %d of %d requests done", len(out), len(requests))
        return out

    def _decode(self, requests: list[SegmentRequest], sampling: SamplingParams, stop_ids: list[int]) -> list[Segment]:
        from transformers import DynamicCache

        dev, pad = self.device, self.pad_token_id
        unique: dict[tuple[int, ...], int] = {}
        row_context = [unique.setdefault(tuple(r.context), len(unique)) for r in requests]
        prompt_ids, prompt_mask = left_pad([list(c) for c in unique], pad)  # (U, Lp): each distinct context once
        attn = prompt_mask.long().to(dev)  # (U, Lp)
        positions = (attn.cumsum(dim=1) - 1).clamp(min=0)  # (U, Lp): 0 at each first real token
        cache_kw = cache_argument(self.model)
        out = self.model(input_ids=prompt_ids.to(dev), attention_mask=attn, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{cache_kw: DynamicCache(config=self.model.config)})
        select = torch.tensor(row_context, device=dev)  # (B,) each request's context
        cache = getattr(out, cache_kw)
        cache.batch_select_indices(select)  # each request gets its own copy of its context's cache
        logits, attn, next_pos = out.logits[:, -1][select], attn[select], positions[:, -1:][select] + 1

        b = len(requests)
        limits = torch.tensor([r.max_new_tokens for r in requests], device=dev)  # (B,)
        t_max = int(limits.max())
        response = torch.full((b, t_max), pad, dtype=torch.long, device=dev)  # (B, T)
        logprobs = torch.zeros((b, t_max), dtype=torch.float32, device=dev)  # (B, T)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)  # (B,)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)  # (B,)
        rows = torch.arange(b, device=dev)  # (A,) rows still decoding
        stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
        draws = _uniforms([r.seed for r in requests], sampling.greedy)
        for step in range(t_max):
            dist = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # (A, V)
            tokens, token_lp = sample_with_uniforms(dist, next(draws).to(dev)[rows], sampling.greedy)  # (A,)
            response[rows, step], logprobs[rows, step], lengths[rows] = tokens, token_lp, step + 1
            hit = torch.isin(tokens, stop)  # (A,)
            if sampling.stop:
                hit |= self._stop_strings_hit(response, rows, step, sampling.stop)
            stopped[rows[hit]] = True
            done = hit | (limits[rows] <= step + 1)
            if bool(done.all()):
                break
            if bool(done.any()):  # drop finished rows from the batch and the cache
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tokens, attn, next_pos = rows[keep], tokens[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)  # (A, Lp+step+1)
            logits = self.model(input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos,
                                use_cache=True, **{cache_kw: cache}).logits[:, -1]  # (A, V)
            next_pos = next_pos + 1
        ids = [r[:n].tolist() for r, n in zip(response.cpu(), lengths.tolist(), strict=True)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [Segment(i, lp[:len(i)].tolist(), text, "stop" if s else "length", self.policy_version)
                for i, lp, text, s in zip(ids, logprobs.cpu(), texts, stopped.tolist(), strict=True)]

    def _stop_strings_hit(self, response: torch.Tensor, rows: torch.Tensor, step: int,
                          stop: tuple[str, ...]) -> torch.Tensor:
        """(A,) bool: rows whose decoded text (special tokens skipped, as vLLM checks ``stop``) now holds a stop
        string; checked after every token, over a window of recent tokens wide enough for the longest string."""
        window = max(len(t) for t in stop) + 4
        tails = response[rows, max(0, step + 1 - window): step + 1].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(t in text for t in stop) for text in texts], dtype=torch.bool, device=rows.device)

    # ------------------------------------------------------------ weight sync
    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[None]:
        """A sync session; nothing to set up: `load_weights` copies each tensor as it arrives."""
        yield
        self.policy_version = version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full tensors (HF names) into the model, checked whole first (`StateDictConsumer`)."""
        StateDictConsumer(self.model).load_weights(weights)

    # ------------------------------------------------------------ memory
    def sleep(self) -> None:
        """On CUDA, move the weights to CPU and free the cache; no-op on CPU."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Move the weights back to the engine's device (no-op on CPU)."""
        if self.device.type == "cuda":
            self.model.to(self.device)


def _uniforms(seeds: list[int | None], greedy: bool) -> Iterator[torch.Tensor]:
    """(B,) uniforms per decoding step: row r's come from a generator seeded with ``seeds[r]`` (None: a fresh
    random seed), ``_DRAWS`` at a time, on the CPU (the same numbers whatever the device)."""
    if greedy:
        while True:
            yield torch.zeros(len(seeds))
    generators = [torch.Generator() for _ in seeds]
    for g, seed in zip(generators, seeds, strict=True):
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed)
    while True:
        block = torch.stack([torch.rand(_DRAWS, generator=g) for g in generators])  # (B, _DRAWS)
        yield from block.unbind(dim=1)


def cache_argument(model) -> str:
    """The KV-cache keyword of ``model.forward`` (and attribute of its output): ``cache`` in current
    transformers, ``past_key_values`` (deprecated there, with a FutureWarning each call) before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
