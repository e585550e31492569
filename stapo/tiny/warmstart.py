"""Supervised warm start of a tiny model on the arithmetic task (docs/demo.md).

RL only improves a policy that sometimes succeeds (STAPO §2.1: a group whose samples all fail carries no
signal), so the demo first fine-tunes the random-init model on pairs rendered exactly as a rollout's.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from stapo.data import format_problem, render_chat
from stapo.tiny.cache import build_cached
from stapo.tiny.model import model_fingerprint
from stapo.tiny.task import CHAT_INSTRUCTION, ArithmeticProblem, arithmetic_problems

#: Default warm-start data: problems drawn with a seed disjoint from evaluation seeds used by the demo.
DEFAULT_TRAIN_SEED = 12345
#: Seed of the choice of which warm-start examples get a bare answer (independent of the model seed).
BARE_ANSWER_SEED = 7


@dataclass(frozen=True)
class SFTExample:
    """Token ids of one warm-start example: ``prompt_ids`` then ``response_ids`` (ends with EOS).
    ``context``: per response token, True where it is context (a tool turn of a multi-turn example,
    docs/tir.md): an input the model reads, never a target."""

    prompt_ids: list[int]
    response_ids: list[int]
    context: tuple[bool, ...] = ()


def with_bare_answers(problems: Sequence[ArithmeticProblem], fraction: float) -> list[ArithmeticProblem]:
    """A copy of ``problems`` where about ``fraction`` of them (chosen deterministically) answer bare,
    ``\\boxed{answer}``: two answer forms, and RL finds out which earns more reward (docs/demo.md)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"bare-answer fraction must be in [0, 1), got {fraction}")
    rng = random.Random(BARE_ANSWER_SEED)
    return [ArithmeticProblem(p.question, p.answer, f"\\boxed{{{p.answer}}}") if rng.random() < fraction else p
            for p in problems]


def prompt_text(tokenizer, question: str, tools: list[dict] | None = None) -> str:
    """The prompt exactly as the data loader renders it (``stapo.data``, docs/rollout.md)."""
    return render_chat(tokenizer, [{"role": "user", "content": format_problem(question, CHAT_INSTRUCTION)}], tools)


def answer_example(tokenizer, prompt: str, solution: str) -> SFTExample:
    """``prompt`` then ``solution + EOS``: the rollout's response format."""
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id; the warm start must teach the model to stop")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return SFTExample(encode(prompt), encode(solution) + [tokenizer.eos_token_id])


def encode_examples(tokenizer, problems: Sequence[ArithmeticProblem]) -> list[SFTExample]:
    """Tokenize prompts and ``solution + EOS`` responses."""
    return [answer_example(tokenizer, prompt_text(tokenizer, p.question), p.solution) for p in problems]


def collate(examples: Sequence[SFTExample], pad_id: int):
    """Right-padded ``input_ids, attention_mask, labels`` ``(B, L)``; labels are -100 except on response
    tokens that are not context, and aligned with the inputs (``sft_loss`` shifts them)."""
    import torch

    length = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)  # (B, L)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)  # (B, L)
    for i, e in enumerate(examples):
        row = e.prompt_ids + e.response_ids
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        targets = torch.tensor(e.response_ids)
        if e.context:
            targets = targets.masked_fill(torch.tensor(e.context), -100)
        labels[i, len(e.prompt_ids) : len(row)] = targets
    return input_ids, attention_mask, labels


def sft_loss(model, input_ids, attention_mask, labels):
    """Token-mean next-token cross-entropy over response tokens (labels != -100)."""
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, L, V)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _train(model_dir: Path, out: Path, encode, steps, lr, batch_size, seed, weight_decay, progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    examples = encode(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    order = torch.randperm(len(examples), generator=gen).tolist()
    cursor, losses, start = 0, [], time.perf_counter()
    warmup = max(1, steps // 20)
    bar = _progress_bar(steps, progress)
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(examples), generator=gen).tolist(), 0
        batch = [examples[i] for i in order[cursor : cursor + batch_size]]
        cursor += batch_size
        input_ids, attention_mask, labels = collate(batch, tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup)
        loss = sft_loss(model, input_ids, attention_mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar(step, losses[-1])
    model.eval()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    meta = {"steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "num_problems": len(examples),
            "losses": losses, "seconds": time.perf_counter() - start}
    (out / "warm_start.json").write_text(json.dumps(meta, indent=1))


def _progress_bar(total: int, enabled: bool):
    """A minimal stderr progress line (no extra dependency) with an ETA from the measured steps; a
    no-op when disabled."""
    import sys

    start = time.perf_counter()

    def update(step: int, loss: float) -> None:
        if enabled and (step + 1 == total or (step + 1) % max(1, total // 20) == 0):
            done, elapsed = step + 1, time.perf_counter() - start
            timing = f"{elapsed:.0f}s" if done == total else f"eta {_minutes(elapsed / done * (total - done))}"
            end = "\n" if done == total else ""
            sys.stderr.write(f"\rwarm start {done}/{total}  loss {loss:.4f}  {timing}   " + end)
            sys.stderr.flush()

    return update


def _minutes(seconds: float) -> str:
    """``42s`` / ``3m05s``."""
    whole = int(round(seconds))
    return f"{whole}s" if whole < 60 else f"{whole // 60}m{whole % 60:02d}s"


def warm_start(
    model_dir: Path,
    out_dir: Path | None = None,
    *,
    problems: Sequence[ArithmeticProblem] | None = None,
    steps: int = 260,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    weight_decay: float = 0.0,
    bare_fraction: float = 0.0,
    progress: bool = True,
) -> Path:
    """Fine-tune ``model_dir`` on (prompt, solution + EOS) pairs; return the saved HF model dir.

    The defaults leave the default model at 33-69% greedy accuracy depending on the seed (docs/demo.md).
    ``out_dir=None`` caches the result keyed by the source weights, the problems and every hyper-parameter.
    """
    model_dir = Path(model_dir)
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    if problems is None:
        problems = arithmetic_problems(4000, seed=DEFAULT_TRAIN_SEED)
    problems = with_bare_answers(problems, bare_fraction) if bare_fraction else list(problems)
    if not problems:
        raise ValueError("warm_start needs at least one problem")
    return train_sft(model_dir, lambda tokenizer: encode_examples(tokenizer, problems), [asdict(p) for p in problems],
                     out_dir, steps=steps, lr=lr, batch_size=batch_size, seed=seed, weight_decay=weight_decay,
                     progress=progress)


def train_sft(model_dir: Path, encode, data: list, out_dir: Path | None = None, *, steps: int, lr: float,
              batch_size: int, seed: int, weight_decay: float, progress: bool) -> Path:
    """Fine-tune ``model_dir`` on ``encode(tokenizer)`` (a list of `SFTExample`); the schedule, cache and
    determinism of `warm_start`. ``data`` (JSON-serializable: what the examples are made of) keys the cache entry."""
    def build(tmp: Path) -> None:
        _train(model_dir, tmp, encode, steps, lr, batch_size, seed, weight_decay, progress)

    payload = {"model": model_fingerprint(model_dir), "problems": data, "steps": steps, "lr": lr,
               "batch_size": batch_size, "seed": seed, "weight_decay": weight_decay}
    return build_cached(out_dir, "warm", payload, build)
