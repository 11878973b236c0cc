"""Qwen3-MoE, an extension of model.py: the mixture-of-experts feed-forward block of transformers'
modeling_qwen3_moe.py (same names; the experts' weights stacked [E, ...], the hub's one Linear per expert at load
and save: hf_expert_names), and the router's load-balancing loss. Qwen3MoE is the model.Qwen3 subclass that
plugs them in: its sparse layers get a SparseMoE as their block's MLP (block_mlp), and the routers' statistics,
which those blocks hand out besides their output, become the auxiliary loss (aux_loss), kept apart from the
language-model loss.

    python -m pytest tests/test_moe.py -q
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import MLP, Qwen3, Qwen3Config, _silu_mul, _swiglu, causal_attention, fused


def route(x, w_router, top_k: int, norm_topk_prob: bool):
    """transformers' Qwen3MoeTopKRouter: x [N, H] -> probs [N, E] (the softmax in fp32, float64 for a float64
    model), weights [N, k] (the top-k probabilities, renormalised to sum 1 when norm_topk_prob, then cast to x's
    dtype), experts [N, k] int64. torch.topk chooses, so ties go as they go in transformers."""
    probs = F.linear(x, w_router).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32))
    top, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return probs, top.to(x.dtype), experts


def experts_loop(x, weights, experts, w_gate, w_up, w_down):
    """Each expert's tokens gathered, its SwiGLU, the outputs added back weighted, expert after expert (the loop of
    transformers' Qwen3MoeExperts): x [N, H], weights and experts [N, k], w_gate/w_up [E, I, H], w_down [E, H, I]
    -> [N, H]. The path on CPU, and the oracle of the grouped GEMM."""
    out = torch.zeros_like(x)
    gates, ups, downs = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)  # one backward node, not one per expert
    for e in range(len(gates)):
        tok, slot = (experts == e).nonzero(as_tuple=True)                          # [n_e] each
        if tok.numel():
            y = _swiglu(x.index_select(0, tok), gates[e], ups[e], downs[e])       # [n_e, H]
            out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def experts_grouped(x, weights, experts, w_gate, w_up, w_down):
    """experts_loop with the (token, slot) pairs sorted by expert once and one grouped GEMM per projection
    (torch._grouped_mm: bf16 on CUDA; its CPU fallback serves the tests). Plain autograd: the backward reuses
    the saved order, offsets and gathered rows; the output is put back by a permutation, with no atomic adds."""
    N, k = experts.shape
    flat = experts.reshape(-1)                                                   # [N*k]
    order = flat.argsort(stable=True)                                            # [N*k] pairs grouped by expert
    counts = torch.zeros(w_gate.shape[0], dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)                                      # [E] each expert's last row + 1
    xs = x.index_select(0, order // k)                                           # [N*k, H] sorted by expert
    g = torch._grouped_mm(xs, w_gate.transpose(1, 2), offs=ends)                 # [N*k, I]
    u = torch._grouped_mm(xs, w_up.transpose(1, 2), offs=ends)
    ys = torch._grouped_mm(fused(_silu_mul, g)(g, u), w_down.transpose(1, 2), offs=ends)   # [N*k, H]
    y = ys.index_select(0, order.argsort())                                      # [N*k, H] back in (token, slot) order
    return (y.view(N, k, -1) * weights[..., None]).sum(1)                        # [N, H]


def grouped_gemm_ok(x, w_gate) -> bool:
    """torch._grouped_mm's CUDA kernel: bf16, rows 16-byte aligned (hidden and moe_intermediate multiples of 8)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and x.shape[-1] % 8 == 0 and w_gate.shape[1] % 8 == 0)


def moe_rows(x, w_router, w_gate, w_up, w_down, top_k, norm_topk_prob):
    """The MoE block on rows: x [N, H] -> (y [N, H], counts [E] float64: the top-k choices of each expert,
    prob_sums [E] fp32 (float64 for float64): the router's probabilities summed over the rows). The last two are
    what the load-balancing loss needs (Qwen3MoE.aux_loss)."""
    probs, weights, experts = route(x, w_router, top_k, norm_topk_prob)
    run = experts_grouped if grouped_gemm_ok(x, w_gate) else experts_loop
    y = run(x, weights, experts, w_gate, w_up, w_down)
    flat = experts.reshape(-1)
    counts = torch.zeros(w_router.shape[0], dtype=torch.float64, device=x.device).index_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float64, device=x.device))
    return y, counts, probs.sum(0)


class Experts(nn.Module):
    """num_experts SwiGLU MLPs of moe_intermediate_size, each projection's weights stacked [E, out, in]: one
    grouped GEMM per projection, and one tensor for FSDP2 to shard. The hub stores one Linear per expert
    (experts.E.gate_proj.weight): hf_names converts at load and save."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, H).normal_(0.0, cfg.initializer_range))
        self.up_proj = nn.Parameter(torch.empty(E, I, H).normal_(0.0, cfg.initializer_range))
        self.down_proj = nn.Parameter(torch.empty(E, H, I).normal_(0.0, cfg.initializer_range))


class SparseMoE(nn.Module):
    """Qwen3-MoE's feed-forward block: the router (gate) sends each token to its top-k experts and adds their
    outputs, weighted by the router's probabilities."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.tile = 0  # rows per tile, as MLP.tile: routed and computed a tile at a time; 0 = untiled
        self.router_stats = cfg.output_router_logits  # hand the load-balancing loss its sums

    def forward(self, x, value_is_read=True):
        """x [B, T, H] -> y [B, T, H], or with router_stats (y, counts [E], prob_sums [E]) (moe_rows), which the
        block hands out for Qwen3MoE.aux_loss; value_is_read as for model.MLP."""
        rows = x.reshape(-1, x.shape[-1])                                        # [B*T, H]
        ws = (self.gate.weight, self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)
        with torch.profiler.record_function("moe"):  # named in profiles (bench/profile_step.py: "experts")
            if self.tile and rows.shape[0] > self.tile:
                y, counts, prob_sums = _TiledMoE.apply(rows, self.tile, value_is_read, self.top_k, self.norm_topk_prob,
                                                       *ws)
            else:
                y, counts, prob_sums = moe_rows(rows, *ws, self.top_k, self.norm_topk_prob)
        return (y.view(x.shape), counts, prob_sums) if self.router_stats else y.view(x.shape)


class _TiledMoE(torch.autograd.Function):
    """The MoE block over tiles of rows, as model._TiledMLP: each tile routed and computed on its own, forward and
    backward, so that the tokens' routed copies [t*k, H] and the experts' [t*k, moe_intermediate] tensors exist one
    tile at a time (whole, at 131,072 tokens a rank, top-8 of Qwen3-30B-A3B: 1.5 GiB for each [N*k, 768] and 4 GiB
    for each [N*k, 2048] in bf16). The backward recomputes each tile under autograd (the same rows route the same
    way) and sums the tiles' weight gradients in fp32 buffers, rounded to the weights' dtype once at the end (each
    tile's own comes out of autograd in that dtype): 3 x E x I x H x 4 bytes while a block runs backward (2.3 GiB
    for Qwen3-30B-A3B)."""

    @staticmethod
    def forward(ctx, x, tile, value_is_read, top_k, norm_topk_prob, *ws):
        # x [N, H]; ws: router [E, H], gate and up [E, I, H], down [E, H, I]
        ctx.tile, ctx.routing = tile, (top_k, norm_topk_prob)
        ctx.save_for_backward(x, *ws)
        counts = torch.zeros(ws[0].shape[0], dtype=torch.float64, device=x.device)                     # [E]
        prob_sums = torch.zeros(ws[0].shape[0], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        ctx.mark_non_differentiable(counts)
        if not value_is_read:  # a recomputed block's backward: only the graph is used (as in _TiledMLP)
            return x.new_empty(x.shape), counts, prob_sums
        y = torch.empty_like(x)
        for xt, yt in zip(x.split(tile), y.split(tile)):
            out, c, p = moe_rows(xt, *ws, top_k, norm_topk_prob)
            yt.copy_(out)
            counts += c
            prob_sums += p
        return y, counts, prob_sums

    @staticmethod
    def backward(ctx, dy, _, dprob_sums):
        with torch.profiler.record_function("moe"):
            return _TiledMoE._backward(ctx, dy, dprob_sums)

    @staticmethod
    def _backward(ctx, dy, dprob_sums):
        x, *ws = ctx.saved_tensors
        dx = torch.empty_like(x)
        acc = [torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32)) for w in ws]
        for xt, dyt, dxt in zip(x.split(ctx.tile), dy.split(ctx.tile), dx.split(ctx.tile)):
            with torch.enable_grad():
                leaves = [xt.detach().requires_grad_(), *(w.detach().requires_grad_() for w in ws)]
                yt, _, pt = moe_rows(*leaves, *ctx.routing)
                grads = torch.autograd.grad([yt, pt], leaves, [dyt, dprob_sums], materialize_grads=True)
            dxt.copy_(grads[0])
            for a, g in zip(acc, grads[1:]):
                a += g
        return dx, None, None, None, None, *(a.to(w.dtype) for a, w in zip(acc, ws))


class Qwen3MoE(Qwen3):
    """Qwen3-MoE: a Qwen3 whose sparse layers (Qwen3Config.sparse) have a SparseMoE as their MLP. With
    output_router_logits, the router's load-balancing loss comes with the language-model loss, apart from it: the
    result's aux_sum (model.Qwen3.forward)."""

    def __init__(self, cfg: Qwen3Config, attn_fn=causal_attention, cp_sum=None):
        """cp_sum(t): sums a tensor in place over the ranks that hold parts of the same sequences (train.py: an
        all_reduce over the context-parallel group); None on one device. Only the load-balancing loss uses it."""
        super().__init__(cfg, attn_fn)
        self.cp_sum = cp_sum

    def block_mlp(self, index: int) -> nn.Module:
        return SparseMoE(self.cfg) if self.cfg.sparse(index) else MLP(self.cfg)

    def aux_loss(self, extras: list, rows: int, n_valid):
        """router_aux_loss_coef x transformers' load_balancing_loss_func x the trained tokens, this rank's share:
        the loss is a sum that train.py divides by the trained-token count, and then this term adds exactly
        coef * aux to the mean, as transformers' outputs.loss has it.

        extras: each sparse block's (counts [E] float64, prob_sums [E]) over this rank's `rows` rows; summed over
        the blocks, C and P. transformers' aux over all layers' rows (R of them, every token, trained or not) is
        E * sum_e (C_e / R) * (P_e / R), for the top-k counts C and probability sums P. The counts carry no
        gradient, so once C, R and the trained tokens are summed over the context-parallel group (cp_sum: one
        all-reduce of E + 2 numbers), each rank's E * sum_e C_e * P_e(this rank) / R^2 is an exact share of the
        sequence's aux, in value and in gradient: cp 2 or 4 gives what one process gives, up to rounding.
        Under data parallelism (or --grad_accum) each sequence has its own aux, weighted by its trained tokens.
        Two differences from transformers, both rounding only: the counts come from the routing's top-k of fp32
        probabilities (transformers takes top-k again of a softmax in the model's dtype, bf16 in training), and
        P sums fp32 probabilities."""
        counts, prob_sums = (torch.stack(t).sum(0) for t in zip(*extras))
        counts, layers = counts.detach(), len(extras)  # a recomputed block hands counts out as differentiable
        E = self.cfg.num_experts
        totals = torch.cat([counts, counts.new_tensor([rows]), n_valid.reshape(1).to(counts.dtype)])  # [E + 2]
        if self.cp_sum is not None:
            self.cp_sum(totals)
        C, R, n = totals[:E], totals[E] * layers, totals[E + 1]
        share = ((E * C / R**2).to(prob_sums.dtype) * prob_sums).sum()
        return self.cfg.router_aux_loss_coef * n.to(share.dtype) * share


def hf_expert_names(name: str, num_experts: int) -> list[str] | None:
    """A stacked expert weight's name (layers.N.mlp.experts.gate_proj [E, I, H]) -> the hub's one name per expert
    (model.layers.N.mlp.experts.E.gate_proj.weight), the layout every transformers version loads (5.x fuses them on
    load, and splits them on save); None for any other parameter."""
    module, _, weight = name.rpartition(".")
    if not module.endswith(".mlp.experts"):
        return None
    return [f"model.{module}.{e}.{weight}.weight" for e in range(num_experts)]
