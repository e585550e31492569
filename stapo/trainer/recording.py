"""Token recording for ``stapo inspect`` (``inspect.record_every``, docs/inspector.md): the ``p``, ``H`` and ``A``
the mask saw, what it silenced, top-5 alternatives and the collision probability (paper Fig. 2, App. C).
"""

from __future__ import annotations

from pathlib import Path

import torch

from stapo.inspect.collect import build_token_record
from stapo.inspect.token_text import piece_text, row_token_texts
from stapo.inspect.records import write_token_record
from stapo.run_dir import token_record_path
from stapo.trainer.microbatch import MicroBatches
from stapo.distributed.policy import response_token_topk
from stapo.distributed.zero3_trace import NO_GRAD, pass_kind


class TokenRecorder:
    def __init__(self, output_dir: Path, *, every: int, is_main: bool, all_minibatches: bool, top_k: int = 5):
        self.output_dir, self.every, self.is_main, self.top_k = Path(output_dir), every, is_main, top_k
        self.all_minibatches = all_minibatches

    def due(self, step: int, minibatch: int) -> bool:
        return self.every > 0 and step % self.every == 0 and (minibatch == 0 or self.all_minibatches)

    @torch.no_grad()
    def record(self, step, minibatch, model, mini, stats, masked, thresholds, rollout, rewards, tokenizer, mask_name,
               opts, rejected=None) -> None:
        """Write one mini-batch's record (rank 0's rows; every rank runs the forward), before its update."""
        shape = (*mini.response_ids.shape, self.top_k)
        topk_ids = torch.zeros(shape, dtype=torch.long)
        topk_probs = torch.zeros(shape)
        collision = torch.zeros(mini.response_ids.shape)
        with pass_kind(model, NO_GRAD):  # ZeRO-3: the stats pass's trace (same modules, same order)
            for rows, inputs in MicroBatches(mini, opts, next(model.parameters()).device, no_grad=True):
                top = response_token_topk(model, inputs, temperature=opts.temperature,
                                          chunk_size=opts.chunk_size, k=self.top_k)
                valid = torch.zeros_like(mini.response_mask[rows])
                valid[:, : inputs.response_mask.shape[1]] = inputs.response_mask.cpu()
                flat = rows[:, None].expand_as(valid)[valid], valid.nonzero()[:, 1]  # (row, column) of each token
                topk_ids[flat] = top.ids.cpu()
                topk_probs[flat] = top.probs.cpu()
                collision[flat] = top.collision.cpu()
        if not self.is_main:
            return
        alone: dict[int, str] = {}
        record = build_token_record(
            step=step, minibatch=minibatch, mask_name=mask_name,
            thresholds={k: float(v) for k, v in thresholds.items()},
            token_ids=mini.response_ids, logprobs=stats.logprobs, entropy=stats.entropy,
            advantages=stats.advantages, response_mask=stats.response_mask, keep=masked.keep,
            topk_ids=topk_ids, topk_probs=topk_probs, collision=collision,
            decode_token=lambda i: piece_text(tokenizer, i),  # a byte piece as \xNN, never U+FFFD
            row_texts=lambda ids: row_token_texts(tokenizer, ids, alone),  # pieces completed by neighbours
            prompt_texts=rollout.prompt_text, response_texts=rollout.response_text, rewards=rewards,
            weights=masked.weights, context_segments=context_segments(rollout, tokenizer),
            rejected=rejected,
        )
        write_token_record(token_record_path(self.output_dir, step, minibatch), record)


def context_segments(rollout, tokenizer) -> list[list] | None:
    """Per row, each run of context tokens (a tool turn) as ``[first position, text]``; None for one turn."""
    if rollout.episodes is None:
        return None
    out = []
    for ids, context in zip(rollout.response_ids.tolist(), rollout.context_mask.tolist()):
        runs, start = [], None
        for t, flag in enumerate([*context, False]):
            if flag and start is None:
                start = t
            elif not flag and start is not None:
                runs.append([start, tokenizer.decode(ids[start:t], skip_special_tokens=False)])
                start = None
        out.append(runs)
    return out
