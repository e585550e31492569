"""Context tokens of multi-turn episodes (tool output, chat-template tokens) are inputs, never targets,
checked on the gradient (docs/tir.md, "Token accounting").

Three rows interleave policy turns with context segments. (1) The gradient of a loss over the policy's
log-probs w.r.t. the decoder's output is exactly zero at every position that predicts a context token
(padded and packed layouts): no context token contributes a term of its own. (2) The parameter gradient
equals an independent reference (a plain transformers forward per sequence, the log-probs of the
policy's tokens only) and differs from the same reference with the context tokens' targets added, so
the check can fail. (3) Through the real update (DeepSpeed), a mask that keeps context tokens changes
neither the loss nor the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from _batches import ragged_rows

# row: (first column, last column + 1) of each context segment inside the response
SEGMENTS = {0: [(3, 6)], 1: [(2, 4)], 2: [(4, 7), (8, 10)]}


def episode_rows():
    """``(prompt_ids, prompt_mask, response_ids, response_mask, context_mask)`` of 3 ragged episodes."""
    prompt_ids, prompt_mask, response_ids, real = ragged_rows([3, 5, 4], [9, 6, 12], seed=3)
    context = torch.zeros_like(real)
    for row, spans in SEGMENTS.items():
        for a, b in spans:
            context[row, a:b] = True
    return prompt_ids, prompt_mask, response_ids, real & ~context, context


def _decoder_output_grad(model, inputs, weights):
    """Gradient of ``sum(weights * logprobs)`` w.r.t. the decoder's last hidden state, and the logprobs."""
    from stapo.distributed.policy import response_token_stats

    captured = {}

    def keep_output(_module, _args, output):
        output.last_hidden_state.retain_grad()
        captured["hidden"] = output.last_hidden_state

    handle = model.get_decoder().register_forward_hook(keep_output)
    try:
        logprobs, _ = response_token_stats(model, inputs, temperature=1.0, chunk_size=16)
    finally:
        handle.remove()
    (logprobs * weights[:, : logprobs.shape[1]]).sum().backward()
    return captured["hidden"].grad, logprobs


@dataclass
class _Seqs:
    """What ``policy_stats`` reads: ids and masks."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    context_mask: torch.Tensor


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def test_no_position_that_predicts_a_context_token_gets_gradient(model):
    from stapo.distributed.policy import teacher_forced_inputs

    prompt_ids, prompt_mask, response_ids, response_mask, context = episode_rows()
    weights = torch.rand(response_ids.shape, generator=torch.Generator().manual_seed(0)) + 0.5
    model.zero_grad()
    inputs = teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, packed=False,
                                   context_mask=context)
    grad, logprobs = _decoder_output_grad(model, inputs, weights)
    per_position = grad.abs().sum(dim=-1)  # (b, Lp + T)
    lp = inputs.prompt_length
    predicts = per_position[:, lp - 1: lp - 1 + response_ids.shape[1]]  # column t predicts response token t
    assert (predicts[response_mask] > 0).all(), "a policy token got no gradient"
    assert (predicts[context] == 0).all(), "a position predicting a context token got gradient"
    assert per_position[:, lp - 1 + response_ids.shape[1]:].sum() == 0 and per_position[:, : lp - 1].sum() == 0
    assert (logprobs[context] == 0).all() and (logprobs[response_mask] < 0).all()

    packed = teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, packed=True,
                                   context_mask=context)
    grad, packed_logprobs = _decoder_output_grad(model, packed, weights)
    flat = grad.abs().sum(dim=-1).flatten()  # (R * S,)
    assert set(flat.nonzero().squeeze(-1).tolist()) == set(packed.target_index.tolist())
    assert len(packed.target_index) == int(response_mask.sum())  # one target per policy token, none per context token
    torch.testing.assert_close(packed_logprobs, logprobs, rtol=0, atol=1e-5)


def _reference_grads(model, parts, weights, with_context_targets: bool) -> dict[str, torch.Tensor]:
    """A plain forward per sequence (its real tokens, no padding, no stapo code): the weighted sum of
    log pi(token | prefix) over the policy's tokens (and, when asked, the context tokens)."""
    prompt_ids, prompt_mask, response_ids, response_mask, context = parts
    model.zero_grad()
    total = torch.zeros(())
    for i in range(len(prompt_ids)):
        real = response_mask[i] | context[i]
        ids = torch.cat([prompt_ids[i][prompt_mask[i]], response_ids[i][real]])[None]  # (1, L)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (L, V)
        lp = int(prompt_mask[i].sum())
        targets = response_mask[i] | (context[i] if with_context_targets else torch.zeros_like(real))
        for t in targets[real].nonzero().squeeze(-1).tolist():
            total = total + weights[i, t] * logp[lp - 1 + t, ids[0, lp + t]]
    total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True])
def test_parameter_gradient_is_that_of_the_policy_tokens_alone(model, packed):
    from stapo.distributed.policy import teacher_forced_inputs

    parts = episode_rows()
    prompt_ids, prompt_mask, response_ids, response_mask, context = parts
    assert int(context.sum()) == 10 and int(response_mask.sum()) == 17  # 27 real response tokens
    weights = torch.rand(response_ids.shape, generator=torch.Generator().manual_seed(1)) - 0.5
    policy_only = _reference_grads(model, parts, weights, with_context_targets=False)
    with_context = _reference_grads(model, parts, weights, with_context_targets=True)
    model.zero_grad()
    inputs = teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, packed=packed,
                                   context_mask=context)
    _decoder_output_grad(model, inputs, weights)
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in policy_only.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the check can fail: counting the context tokens as targets moves the gradient far beyond tolerance
    gap = max(float((with_context[n] - policy_only[n]).abs().max()) for n in policy_only)
    assert gap > 1e-3


@pytest.mark.slow
def test_a_mask_that_keeps_context_tokens_changes_nothing(tiny_model_dir):
    import dataclasses

    from transformers import AutoModelForCausalLM

    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.distributed.process_group import init_distributed
    from stapo.trainer.update import TrainBatch, UpdateOptions, policy_stats, update_minibatch

    init_distributed()
    prompt_ids, prompt_mask, response_ids, response_mask, context = episode_rows()
    opts = UpdateOptions(chunk_size=16, micro_batch_size=2)
    runs = []
    for keep in (response_mask, response_mask | context):  # the second would train on tool output
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        engine = build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=2, zero_stage=0, bf16=False)
        batch = TrainBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.tensor([1.0, -0.5, 0.7]),
                           *policy_stats(engine.module, _Seqs(prompt_ids, prompt_mask, response_ids, response_mask,
                                                              context), opts), context_mask=context)
        offset = torch.where(response_mask, 0.3, 0.0)  # theta_old off theta: ratios move off 1
        batch = dataclasses.replace(batch, old_logprobs=batch.old_logprobs - offset)
        captured = {}
        real_step = GradientAccumulation.step

        def step(self, captured=captured, real_step=real_step):
            captured.update({n: p.grad.clone() for n, p in self.engine.module.named_parameters()})
            return real_step(self)

        GradientAccumulation.step = step
        try:
            sums = update_minibatch(engine, engine.module, batch, keep, opts)
        finally:
            GradientAccumulation.step = real_step
        runs.append((float(sums["loss"]), float(sums["kept_tokens"]), captured))
    (loss_a, kept_a, grads_a), (loss_b, kept_b, grads_b) = runs
    assert kept_a == kept_b == 17 and loss_a == loss_b
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert any(g.abs().sum() > 0 for g in grads_a.values())

