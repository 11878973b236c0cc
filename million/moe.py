"""Qwen3-MoE, an extension of model.py: its config (Qwen3MoeConfig), the mixture-of-experts feed-forward block of
transformers' modeling_qwen3_moe.py (same names; the experts' weights stacked [E, ...], the hub's one Linear per
expert at load and save: hf_expert_names), and the router's load-balancing loss. Qwen3MoE is the model.Qwen3
subclass that plugs them in: its sparse layers get a SparseMoE as their block's MLP (the model's `mlp` argument),
and the routers' statistics become the auxiliary loss (aux_loss), kept apart from the language-model loss (MoENLL).
Its gradient reaches the routers through the activations (LoadBalance): the core's blocks carry only y.
Qwen3.5-MoE (qwen3_5.Qwen3_5Moe) takes the same block with a shared expert beside it (SharedExpertMoE) and the same
loss (RouterLoss).

    python -m pytest tests/test_moe.py -q
"""
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from loss import NLL
from model import MLP, Qwen3, Qwen3Config, _silu_mul, _swiglu, causal_attention, fused


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3Config and the fields of transformers' Qwen3MoeConfig (model_type "qwen3_moe"), with its defaults."""
    model_class: ClassVar[str] = "moe.Qwen3MoE"  # what builds it (model.Qwen3 refuses it: its MLPs are dense)
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)  # dense layers among the sparse ones
    output_router_logits: bool = False  # true: router_aux_loss_coef x the load-balancing loss joins the objective
    router_aux_loss_coef: float = 0.001

    def sparse(self, layer: int) -> bool:
        """Is this layer a mixture of experts? Exactly as transformers' Qwen3MoeDecoderLayer decides."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def route(x, w_router, top_k: int, norm_topk_prob: bool):
    """transformers' Qwen3MoeTopKRouter: x [N, H] -> probs [N, E] (the softmax in fp32, float64 for a float64
    model), weights [N, k] (the top-k probabilities, renormalised to sum 1 when norm_topk_prob, then cast to x's
    dtype), experts [N, k] int64. torch.topk chooses, so ties go as they go in transformers."""
    probs = F.linear(x, w_router).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32))
    top, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return probs, top.to(x.dtype), experts


def expert_adapters(adapters, E: int) -> list:
    """PEFT's LoRA on stacked expert weights (its target_parameters): for gate_up ([E, 2 I, H], gate then up) and
    for down, one A [r E, in] and one B [out, r E] -> per expert A [E, r, in] and B [E, out, r], expert e's delta
    being B[:, e::E] @ A[e r:(e+1) r] (its rows of A a block, its columns of B every E-th). () -> []."""
    out = []
    for a, b in zip(adapters[::2], adapters[1::2]):
        r = a.shape[0] // E
        out += [a.view(E, r, a.shape[1]), b.view(b.shape[0], r, E).permute(2, 0, 1).contiguous()]
    return out


def _adapted_swiglu(x, w_gate, w_up, w_down, a_gu, b_gu, a_d, b_d, s):
    """One expert's SwiGLU with LoRA on gate_up (one A for gate and up, B's rows gate then up) and on down."""
    g, u = F.linear(F.linear(x, a_gu) * s, b_gu).chunk(2, -1)                    # [n, I] each
    h = fused(_silu_mul, x)(F.linear(x, w_gate) + g, F.linear(x, w_up) + u)
    return F.linear(h, w_down) + F.linear(F.linear(h, a_d) * s, b_d)


def experts_loop(x, weights, experts, w_gate, w_up, w_down, adapters=(), scaling=0.0):
    """Each expert's tokens gathered, its SwiGLU, the outputs added back weighted, expert after expert (the loop of
    transformers' Qwen3MoeExperts): x [N, H], weights and experts [N, k], w_gate/w_up [E, I, H], w_down [E, H, I]
    -> [N, H]. adapters: LoRA's (A, B) of gate_up, then of down, in PEFT's layout (expert_adapters), or ().
    The path on CPU, and the oracle of the grouped GEMM."""
    out = torch.zeros_like(x)
    per_expert = [w.unbind(0) for w in (w_gate, w_up, w_down, *expert_adapters(adapters, w_gate.shape[0]))]
    for e in range(w_gate.shape[0]):  # one backward node per stacked tensor (unbind), not one per expert
        tok, slot = (experts == e).nonzero(as_tuple=True)                          # [n_e] each
        if tok.numel():
            ws = [w[e] for w in per_expert]
            xe = x.index_select(0, tok)
            y = _adapted_swiglu(xe, *ws, scaling) if adapters else _swiglu(xe, *ws)  # [n_e, H]
            out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


class _Rows(torch.autograd.Function):
    """out [R, H] = x[src // k]: a gather whose backward is a gather too, by back (src's inverse permutation),
    then a sum over each row's k copies. index_select's own backward is a scatter-add with atomics: in bf16 it was
    the MoE blocks' largest kernel after their GEMMs, and a tile of the 35B-A3B runs 3.9 ms faster without it on an
    H100 (bench/moe_rows.py; bench/NOTES.md, "The MoE's row permutations")."""

    @staticmethod
    def forward(ctx, x, src, back, k):
        ctx.save_for_backward(back)
        ctx.k = k
        return x.index_select(0, src // k)

    @staticmethod
    def backward(ctx, dout):
        back, = ctx.saved_tensors
        dx = dout.index_select(0, back)                                          # [R, H] in src's order
        return dx.view(-1, ctx.k, dx.shape[-1]).sum(1) if ctx.k > 1 else dx, None, None, None


def experts_grouped(x, weights, experts, w_gate, w_up, w_down, adapters=(), scaling=0.0):
    """experts_loop with the (token, slot) pairs sorted by expert once and one grouped GEMM per projection
    (torch._grouped_mm: bf16 on CUDA; its CPU fallback serves the tests), two thin ones per adapter. Plain
    autograd but for the two permutations of rows (_Rows): the backward reuses the saved order, offsets and
    gathered rows, and neither direction adds atomically."""
    N, k = experts.shape
    flat = experts.reshape(-1)                                                   # [N*k]
    order = flat.argsort(stable=True)                                            # [N*k] pairs grouped by expert
    unsort = order.argsort()                                                     # [N*k] its inverse
    counts = torch.zeros(w_gate.shape[0], dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)                                      # [E] each expert's last row + 1

    def mm(a, w):  # rows a [N*k, in] (sorted), stacked w [E, out, in] -> [N*k, out]
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)

    xs = _Rows.apply(x, order, unsort, k)                                        # [N*k, H] sorted by expert
    g, u = mm(xs, w_gate), mm(xs, w_up)                                          # [N*k, I] each
    if adapters:
        a_gu, b_gu, a_d, b_d = expert_adapters(adapters, w_gate.shape[0])
        dg, du = mm(mm(xs, a_gu) * scaling, b_gu).chunk(2, -1)                   # [N*k, r] -> [N*k, I] each
        g, u = g + dg, u + du
    h = fused(_silu_mul, g)(g, u)
    ys = mm(h, w_down)                                                           # [N*k, H]
    if adapters:
        ys = ys + mm(mm(h, a_d) * scaling, b_d)
    y = _Rows.apply(ys, unsort, order, 1)                                        # [N*k, H] back in (token, slot) order
    # the weighted sum of each token's k outputs as one batched product: it reads y once, where a product then a sum
    # wrote [N*k, H] again both ways (0.59 ms less a tile on an H100: bench/moe_rows.py's "combine" row)
    return torch.bmm(weights.unsqueeze(1), y.view(N, k, -1)).squeeze(1)         # [N, 1, k] @ [N, k, H] -> [N, H]


def grouped_gemm_ok(x, w_gate, adapters=()) -> bool:
    """torch._grouped_mm's CUDA kernel: bf16 throughout, rows 16-byte aligned (hidden, moe_intermediate and the
    adapters' rank multiples of 8)."""
    rank = adapters[0].shape[0] // w_gate.shape[0] if adapters else 8
    return (x.is_cuda and hasattr(torch, "_grouped_mm")
            and all(t.dtype == torch.bfloat16 for t in (x, w_gate, *adapters))
            and x.shape[-1] % 8 == 0 and w_gate.shape[1] % 8 == 0 and rank % 8 == 0)


def moe_rows(x, ws, top_k, norm_topk_prob, scaling=0.0):
    """The MoE block on rows: x [N, H], ws (router [E, H], gate, up, down, then LoRA's adapters if any:
    Experts.weights) -> (y [N, H], counts [E] float64: the top-k choices of each expert, prob_sums [E] fp32
    (float64 for float64): the router's probabilities summed over the rows). The last two are what the
    load-balancing loss needs (Qwen3MoE.aux_loss)."""
    w_router, w_gate, w_up, w_down, *adapters = ws
    probs, weights, experts = route(x, w_router, top_k, norm_topk_prob)
    run = experts_grouped if grouped_gemm_ok(x, w_gate, adapters) else experts_loop
    y = run(x, weights, experts, w_gate, w_up, w_down, tuple(adapters), scaling)
    flat = experts.reshape(-1)
    counts = torch.zeros(w_router.shape[0], dtype=torch.float64, device=x.device).index_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float64, device=x.device))
    return y, counts, probs.sum(0)


class Experts(nn.Module):
    """num_experts SwiGLU MLPs of moe_intermediate_size, each projection's weights stacked [E, out, in]: one
    grouped GEMM per projection, and one tensor for FSDP2 to shard. The hub stores one Linear per expert
    (experts.E.gate_proj.weight): hf_names converts at load and save."""

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, H).normal_(0.0, cfg.initializer_range))
        self.up_proj = nn.Parameter(torch.empty(E, I, H).normal_(0.0, cfg.initializer_range))
        self.down_proj = nn.Parameter(torch.empty(E, H, I).normal_(0.0, cfg.initializer_range))

    scaling = 0.0  # LoRA's alpha / rank (lora.LoRAExperts)

    def weights(self) -> tuple:
        """The stacked weights, then LoRA's adapters if any (lora.LoRAExperts): what moe_rows takes after the
        router's."""
        return self.gate_proj, self.up_proj, self.down_proj


class SparseMoE(nn.Module):
    """Qwen3-MoE's feed-forward block: the router (gate) sends each token to its top-k experts and adds their
    outputs, weighted by the router's probabilities."""

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.tile = 0  # rows per tile, as MLP.tile: routed and computed a tile at a time; 0 = untiled
        self.balance = None  # the LoadBalance of the model's forward while the load-balancing loss is on

    def forward(self, x, value_is_read=True):
        """x [B, T, H] -> y [B, T, H]; value_is_read as for model.MLP. Under a LoadBalance, y passes through it:
        it records the router's statistics, and its backward adds the load-balancing loss's gradient."""
        y, counts, prob_sums = self.with_stats(x, value_is_read)
        return y if self.balance is None else self.balance(y, counts, prob_sums)

    def with_stats(self, x, value_is_read=True):
        """x [B, T, H] -> (y [B, T, H], counts [E], prob_sums [E]) (moe_rows)."""
        rows = x.reshape(-1, x.shape[-1])                                        # [B*T, H]
        ws, routing = (self.gate.weight, *self.experts.weights()), (self.top_k, self.norm_topk_prob,
                                                                     self.experts.scaling)
        with torch.profiler.record_function("moe"):  # named in profiles (bench/profile_step.py: "experts")
            if self.tile and rows.shape[0] > self.tile:
                y, counts, prob_sums = _TiledMoE.apply(rows, self.tile, value_is_read, routing, *ws)
            else:
                y, counts, prob_sums = moe_rows(rows, ws, *routing)
        return y.view(x.shape), counts, prob_sums


class SharedExpertMoE(SparseMoE):
    """Qwen3.5-MoE's feed-forward block (transformers' Qwen3_5MoeSparseMoeBlock): SparseMoE's routed experts (their
    top-k weights always renormalised: cfg.norm_topk_prob is True) plus a shared SwiGLU expert that every token
    passes through, scaled per token by sigmoid(shared_expert_gate(x)). The shared expert is model.py's MLP, tiled
    with the routed experts (the `tile` lever)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        width = SimpleNamespace(hidden_size=cfg.hidden_size, intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert = MLP(width)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x, value_is_read=True):
        """As SparseMoE.forward. The shared expert's value is always computed: the gate's product reads it."""
        self.shared_expert.tile = self.tile
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x, value_is_read) + shared


class _TiledMoE(torch.autograd.Function):
    """The MoE block over tiles of rows, as model._TiledMLP: each tile routed and computed on its own, forward and
    backward, so that the tokens' routed copies [t*k, H] and the experts' [t*k, moe_intermediate] tensors exist one
    tile at a time (whole, at 131,072 tokens a rank, top-8 of Qwen3-30B-A3B: 1.5 GiB for each [N*k, 768] and 4 GiB
    for each [N*k, 2048] in bf16). The backward recomputes each tile under autograd (the same rows route the same
    way) and sums the tiles' weight gradients in fp32 buffers, rounded to the weights' dtype once at the end (each
    tile's own comes out of autograd in that dtype): 3 x E x I x H x 4 bytes while a block runs backward (2.3 GiB
    for Qwen3-30B-A3B). Frozen weights (LoRA's) get neither the buffers nor the GEMMs; the experts' adapters, if any
    (lora.LoRAExperts), are weights like the others."""

    @staticmethod
    def forward(ctx, x, tile, value_is_read, routing, *ws):
        # x [N, H]; ws: router [E, H], gate and up [E, I, H], down [E, H, I], LoRA's adapters if any; routing:
        # (top_k, norm_topk_prob, LoRA's scaling)
        ctx.tile, ctx.routing = tile, routing
        ctx.save_for_backward(x, *ws)
        counts = torch.zeros(ws[0].shape[0], dtype=torch.float64, device=x.device)                     # [E]
        prob_sums = torch.zeros(ws[0].shape[0], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        ctx.mark_non_differentiable(counts)
        if not value_is_read:  # a recomputed block's backward: only the graph is used (as in _TiledMLP)
            return x.new_empty(x.shape), counts, prob_sums
        y = torch.empty_like(x)
        for xt, yt in zip(x.split(tile), y.split(tile)):
            out, c, p = moe_rows(xt, ws, *routing)
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
        # Only the weights that train get gradients: under LoRA the router and the experts are frozen, and their
        # weight gradients (a third of the experts' GEMMs in the backward, the fp32 sums) are not computed
        train = ctx.needs_input_grad[4:]
        dx = torch.empty_like(x)
        acc = [torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32)) if t else None
               for w, t in zip(ws, train)]
        for xt, dyt, dxt in zip(x.split(ctx.tile), dy.split(ctx.tile), dx.split(ctx.tile)):
            with torch.enable_grad():
                leaves = [xt.detach().requires_grad_(), *(w.detach().requires_grad_(t) for w, t in zip(ws, train))]
                yt, _, pt = moe_rows(leaves[0], leaves[1:], *ctx.routing)
                wanted = [leaves[0], *(w for w, t in zip(leaves[1:], train) if t)]
                grads = torch.autograd.grad([yt, pt], wanted, [dyt, dprob_sums], materialize_grads=True)
            dxt.copy_(grads[0])
            for a, g in zip([a for a in acc if a is not None], grads[1:]):
                a += g
        return dx, None, None, None, *(None if a is None else a.to(w.dtype) for a, w in zip(acc, ws))


@dataclass
class MoENLL(NLL):
    """loss.NLL and the load-balancing loss apart from it: aux_sum, on loss_sum's scale (None without
    output_router_logits). total() is what backward starts from."""
    aux_sum: torch.Tensor | None = None

    def total(self):
        return self.loss_sum if self.aux_sum is None else self.loss_sum + self.aux_sum


class RouterLoss:
    """The load-balancing loss around a mixture-of-experts model's forward, placed before the model class in its
    bases (Qwen3MoE here, qwen3_5.Qwen3_5Moe): the model's forward with labels, then the routers' statistics, which
    every SparseMoE records into this forward's LoadBalance, become MoENLL's aux_sum. Needs self.cfg (num_experts,
    output_router_logits, router_aux_loss_coef) and self.cp_sum."""

    def forward(self, input_ids, position_ids=None, labels=None, loss_chunk=2048, doc_lens=None):
        """The model's forward; with labels, a MoENLL."""
        balance = LoadBalance() if labels is not None and self.cfg.output_router_logits else None
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.balance = balance
        out = super().forward(input_ids, position_ids, labels, loss_chunk, doc_lens)
        if labels is None:
            return out
        aux = None
        if balance is not None and balance.counts:
            balance.recording = False  # what a recomputed block runs in backward is not counted again
            aux = self.aux_loss(balance, input_ids.numel(), out.n_valid, out.loss_sum).to(out.loss_sum.dtype)
        return MoENLL(out.loss_sum, out.n_valid, out.row_nll, aux)

    def aux_loss(self, balance: "LoadBalance", rows: int, n_valid, loss_sum):
        """router_aux_loss_coef x transformers' load_balancing_loss_func x the trained tokens, this rank's share:
        the loss is a sum that train.py divides by the trained-token count, and then this term adds exactly
        coef * aux to the mean, as transformers' outputs.loss has it.

        balance: each sparse block's (counts [E] float64, prob_sums [E]) over this rank's `rows` rows; summed over
        the blocks, C and P. transformers' aux over all layers' rows (R of them, every token, trained or not) is
        E * sum_e (C_e / R) * (P_e / R), for the top-k counts C and probability sums P. The counts carry no
        gradient, so once C, R and the trained tokens are summed over the context-parallel group (cp_sum: one
        all-reduce of E + 2 numbers), each rank's E * sum_e C_e * P_e(this rank) / R^2 is an exact share of the
        sequence's aux, in value and in gradient: cp 2 or 4 gives what one process gives, up to rounding.
        Under data parallelism (or --grad_accum) each sequence has its own aux, weighted by its trained tokens.
        Two differences from transformers, both rounding only: the counts come from the routing's top-k of fp32
        probabilities (transformers takes top-k again of a softmax in the model's dtype, bf16 in training), and
        P sums fp32 probabilities. The term is a node on loss_sum (_LoadBalancingLoss), whose backward hands
        each block's prob_sums its gradient, coef * n * E * C / R^2 x the upstream one, through `balance`."""
        counts, prob_sums = torch.stack(balance.counts).sum(0), torch.stack(balance.prob_sums).sum(0)
        E, layers = self.cfg.num_experts, len(balance.counts)
        totals = torch.cat([counts, counts.new_tensor([rows]), n_valid.reshape(1).to(counts.dtype)])  # [E + 2]
        if self.cp_sum is not None:
            self.cp_sum(totals)
        C, R, n = totals[:E], totals[E] * layers, totals[E + 1]
        w = (E * C / R**2).to(prob_sums.dtype)                        # [E] d(share) / d(P)
        scale = self.cfg.router_aux_loss_coef * n.to(w.dtype)        # d(aux) / d(share)
        return _LoadBalancingLoss.apply(loss_sum, scale * (w * prob_sums).sum(), balance, w, scale)


class Qwen3MoE(RouterLoss, Qwen3):
    """Qwen3-MoE: a Qwen3 whose sparse layers (Qwen3MoeConfig.sparse) have a SparseMoE as their MLP. With labels,
    forward returns a MoENLL; with output_router_logits its aux_sum is the load-balancing loss (aux_loss), and
    out.total() backward gives the gradient of both."""

    def __init__(self, cfg: Qwen3MoeConfig, attn_fn=causal_attention, cp_sum=None):
        """cp_sum(t): sums a tensor in place over the ranks that hold parts of the same sequences (train.py: an
        all_reduce over the context-parallel group); None on one device. Only the load-balancing loss uses it."""
        super().__init__(cfg, attn_fn, mlp=lambda i: SparseMoE(cfg) if cfg.sparse(i) else MLP(cfg))
        self.cp_sum = cp_sum


class LoadBalance:
    """One forward's load-balancing loss, carried beside the activations as Megatron-LM's MoEAuxLossAutoScaler
    carries it: the gradient w.r.t. a block's probability sums, coef * n * E * C / R^2, needs the counts of every
    block (and, under context parallelism, of every rank), known only when the forward is over. So each sparse
    block's output passes through a node (_PassThrough) whose backward adds that gradient to the router's, and
    the loss term itself is a node on loss_sum (_LoadBalancingLoss) that leaves the gradient here first: every
    block's output leads to loss_sum, so autograd runs it before any block's backward. The SparseMoEs hold the
    last forward's LoadBalance, which a recomputed block's backward reads: each backward follows its own forward
    before the next forward (as train.py runs them)."""

    def __init__(self):
        self.counts, self.prob_sums = [], []  # per sparse block, recorded by the forward: [E] float64, [E]
        self.recording = True
        self.grad = None  # [E]: the objective's gradient w.r.t. each block's prob_sums, once the term's backward ran

    def __call__(self, y, counts, prob_sums):
        """A SparseMoE's output y [B, T, H] and its router's statistics -> y, through the pass-through node."""
        if self.recording:
            self.counts.append(counts.detach())
            self.prob_sums.append(prob_sums.detach())
        return _PassThrough.apply(y, prob_sums, self) if prob_sums.requires_grad else y


class _PassThrough(torch.autograd.Function):
    """y as it is; backward: dy to y, and the load-balancing loss's gradient to the block's prob_sums (none when
    the backward did not start from the loss term: out.loss_sum alone)."""

    @staticmethod
    def forward(ctx, y, prob_sums, balance):
        ctx.balance = balance
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy, ctx.balance.grad, None


class _LoadBalancingLoss(torch.autograd.Function):
    """The load-balancing loss's value (aux, computed from detached statistics) as a node on loss_sum. Its
    backward stores d(objective)/d(prob_sums) = g * scale * w in balance for the blocks' _PassThrough nodes, and
    gives loss_sum nothing (it only orders this node before the blocks')."""

    @staticmethod
    def forward(ctx, loss_sum, aux, balance, w, scale):
        ctx.balance, ctx.w, ctx.scale = balance, w, scale
        return aux.clone()  # not a view: FSDP2 warns of a module output that is one

    @staticmethod
    def backward(ctx, g):
        ctx.balance.grad = g * ctx.scale * ctx.w
        return None, None, None, None, None


def hf_expert_names(name: str, num_experts: int) -> list[str] | None:
    """A stacked expert weight's name (layers.N.mlp.experts.gate_proj [E, I, H]) -> the hub's one name per expert
    (model.layers.N.mlp.experts.E.gate_proj.weight), the layout every transformers version loads (5.x fuses them on
    load, and splits them on save); None for any other parameter."""
    module, _, weight = name.rpartition(".")
    if not module.endswith(".mlp.experts"):
        return None
    return [f"model.{module}.{e}.{weight}.weight" for e in range(num_experts)]
