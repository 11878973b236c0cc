"""AdamW for bf16 weights whose small updates are not lost: stochastic rounding.

With fp32 master weights and AdamW states a parameter costs 16 bytes (weights, gradients, two moments), 131 GB for
Qwen3-8B: more than one GPU holds. In bf16 it costs 8, but rounding to nearest loses every update smaller than
half a bf16 step (~1/256 of the weight): at lr 1e-5, 98% of the weights never move (tests/test_train.py).

Here the weights and both moments stay bf16 and nothing else is kept. Each step computes the update in fp32 and
rounds the new weight (and the new moments) to one of its two bf16 neighbours at random, up with probability
equal to the distance from the lower one over the gap. The rounding is then exact on average: an update of a
tenth of a bf16 step moves the weight one step in one case out of ten, and over many steps the weight follows the
fp32 trajectory within the rounding's noise (tests/test_optim.py; the loss curves in bench/results/sr_curve.json).

The random bits come from a generator seeded by (seed, step, rank), so a resumed run on the same ranks repeats
them: resume stays bit for bit.
"""
import torch

from parallel import local_shard

CHUNK = 1 << 24  # elements updated at once: the fp32 temporaries of one chunk, not of the largest tensor


def round_stochastic(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding |x| up with probability (|x| - lower) / gap. bf16 is fp32's upper 16 bits: add
    uniform random 16-bit noise to the lower 16 and cut them off (a carry rounds up, as it should; the sign bit is
    apart, so negative values round in magnitude the same way)."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=gen)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536 = 0xFFFF0000


class AdamWStochastic(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) on bf16 parameters with bf16 moments, each updated
    in fp32 and stored with stochastic rounding. FSDP2's sharded parameters are updated shard by shard."""

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 seed: int = 0, rank: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed, self.rank = seed, rank

    @torch.no_grad()
    def step(self):
        gen = None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, g = local_shard(p), local_shard(p.grad)
                if w.dtype != torch.bfloat16:
                    raise ValueError(f"stochastic rounding is for bf16 weights, got {w.dtype}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = int(state["step"].item())
                if gen is None:  # one stream per step and rank: the same bits after a resume
                    gen = torch.Generator(w.device).manual_seed((self.seed * 1_000_003 + t) * 4099 + self.rank)
                m, v = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
                c1, c2 = 1 - b1 ** t, 1 - b2 ** t
                for w_, g_, m_, v_ in zip(*(x.view(-1).split(CHUNK) for x in (w, g, m, v))):
                    gf = g_.float()
                    mf = m_.float().mul_(b1).add_(gf, alpha=1 - b1)
                    vf = v_.float().mul_(b2).addcmul_(gf, gf, value=1 - b2)
                    x = w_.float().mul_(1 - lr * wd)
                    x.addcdiv_(mf, vf.div(c2).sqrt_().add_(eps), value=-lr / c1)
                    w_.copy_(round_stochastic(x, gen))
                    m_.copy_(round_stochastic(mf, gen))
                    v_.copy_(round_stochastic(vf, gen))
