"""Token recording for ``stapo inspect`` (option ``inspect.record_every``).

Every N iterations the first mini-batch's per-token statistics — exactly the ``p``, ``H`` and ``A``
the mask saw, what it silenced, plus top-5 alternatives and the collision probability (paper
Fig. 2, App. C) — are written to ``output_dir/token_records/``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stapo.inspect.collect import build_token_record
from stapo.inspect.records import write_token_record
from stapo.losses import registered_name
from stapo.run_dir import token_record_path
from stapo.trainer.policy import response_token_topk
from stapo.trainer.update import micro_slices


class TokenRecorder:
    def __init__(self, output_dir: Path, *, every: int, is_main: bool, top_k: int = 5):
        self.output_dir, self.every, self.is_main, self.top_k = Path(output_dir), every, is_main, top_k

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def record(self, step, model, mini, stats, masked, rollout, rewards, tokenizer, mask, opts) -> None:
        """Write the record of one mini-batch (rank 0's rows; every rank runs the forward)."""
        shape = (*mini.response_ids.shape, self.top_k)
        topk_ids = torch.zeros(shape, dtype=torch.long)
        topk_probs = torch.zeros(shape)
        collision = torch.zeros(mini.response_ids.shape)
        device = next(model.parameters()).device
        for sl in micro_slices(len(mini), opts.micro_batch_size):
            inputs = mini.policy_inputs(sl).to(device)
            top = response_token_topk(model, inputs, temperature=opts.temperature,
                                      chunk_size=opts.chunk_size, k=self.top_k)
            valid = torch.zeros_like(mini.response_mask[sl])
            valid[:, : inputs.response_mask.shape[1]] = inputs.response_mask.cpu()
            topk_ids[sl][valid] = top.ids.cpu()
            topk_probs[sl][valid] = top.probs.cpu()
            collision[sl][valid] = top.collision.cpu()
        if not self.is_main:
            return
        thresholds = {k: float(v) for k, v in masked.thresholds.items()}
        thresholds.setdefault("tau_p", float(getattr(mask, "tau_p", float("nan"))))
        record = build_token_record(
            step=step, minibatch=0, mask_name=registered_name(mask) or type(mask).__name__,
            thresholds=thresholds,
            token_ids=mini.response_ids, logprobs=stats.logprobs, entropy=stats.entropy,
            advantages=stats.advantages, response_mask=stats.response_mask, keep=masked.keep,
            topk_ids=topk_ids, topk_probs=topk_probs, collision=collision,
            decode_token=lambda i: tokenizer.decode([i]),
            prompt_texts=rollout.prompt_text, response_texts=rollout.response_text, rewards=rewards,
        )
        write_token_record(token_record_path(self.output_dir, step), record)
