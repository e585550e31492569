"""GuardedAdamW (ZeRO stage 0): clips from the pre-clip norm, skips non-finite steps untouched."""

import math

import torch

from stapo.distributed.deepspeed_engine import GuardedAdamW


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def test_clips_like_clip_grad_norm_then_steps_like_adamw():
    ours, ref = _params(), _params()
    grads = [torch.full((3, 4), 2.0), torch.full((5,), -1.0)]  # norm = sqrt(12*4 + 5*1) = sqrt(53)
    for p, q, g in zip(ours, ref, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt = GuardedAdamW(ours, lr=0.1, weight_decay=0.01)
    opt.max_grad_norm = 1.0
    opt.step()
    norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01).step()
    assert abs(opt._global_grad_norm - math.sqrt(53)) < 1e-5 and abs(float(norm) - math.sqrt(53)) < 1e-5
    assert not opt.overflow
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q)


def test_non_finite_gradient_skips_and_leaves_state_untouched():
    params = _params()
    opt = GuardedAdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # one good step creates moments
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    params[0].grad = torch.full_like(params[0], float("nan"))
    params[1].grad = torch.ones_like(params[1])
    opt.step()
    assert opt.overflow and not math.isfinite(opt._global_grad_norm)
    for p, b, m in zip(params, before, moments):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["exp_avg"], m)
        assert opt.state[p]["step"] == 1
