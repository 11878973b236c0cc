"""Stochastic rounding into bf16 weights (optim.py) against fp32 master weights, in-process: the rounding is unbiased
and lands on a neighbour, and large steps match fp32 AdamW. Through train.py (one step taking the fp32 run's updates
on average, a loss curve within seed noise, a resumed run): tests/e2e/test_optim.py."""
import torch

from million import optim


def test_rounding_is_unbiased_and_lands_on_a_neighbour():
    gen = torch.Generator().manual_seed(0)
    lo = torch.tensor([1.0, -3.0, 2.0 ** -20, 1000.0])             # bf16 values
    gap = torch.tensor([2.0 ** -7, 2.0 ** -6, 2.0 ** -27, 4.0])     # the bf16 step above each (in magnitude)
    for frac in (0.0, 0.1, 0.5, 0.93):
        x = lo + torch.sign(lo) * frac * gap                        # fp32, between two bf16 neighbours
        draws = torch.stack([optim.round_stochastic(x.clone(), gen).float() for _ in range(4000)])
        up = draws.abs() > lo.abs()
        assert ((draws == lo) | (draws == lo + torch.sign(lo) * gap)).all()
        assert torch.allclose(up.double().mean(0), torch.full((4,), frac, dtype=torch.float64), atol=0.03), frac
    bf = torch.randn(1000, generator=gen).bfloat16()
    assert torch.equal(optim.round_stochastic(bf.float(), gen), bf)  # exact values stay


def test_large_steps_match_fp32_adamw():
    """Updates far above bf16's resolution (lr 0.05, 5 steps): the weights' moves are torch's fp32 AdamW's within
    the rounding of the gradients, the moments and the weights to bf16 (4.0% of the moves' norm measured)."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(3000, generator=gen).bfloat16()
    grads = [torch.randn(3000, generator=gen) for _ in range(5)]
    ref = torch.nn.Parameter(w0.float())
    sr = torch.nn.Parameter(w0.clone())
    a = torch.optim.AdamW([ref], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    b = optim.AdamWStochastic([sr], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    for g in grads:
        ref.grad, sr.grad = g.clone(), g.bfloat16()
        a.step()
        b.step()
    err, move = sr.detach().float() - ref.detach(), ref.detach() - w0.float()
    assert err.norm() / move.norm() < 0.06
