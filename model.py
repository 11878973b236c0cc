"""Qwen3 and Qwen3-MoE for million-token training, in three parts:

1. The plain Qwen3: config, RoPE with YaRN, RMSNorm, attention, SwiGLU MLP, the mixture-of-experts block of
   Qwen3-MoE, the decoder. It reads like transformers' modeling_qwen3.py and modeling_qwen3_moe.py (same names;
   the experts' weights stacked [E, ...], the hub's one-Linear-per-expert layout at load and save) and can be
   diffed against them.
2. Memory levers: what lets one sequence of a million tokens fit. Custom autograd Functions that keep less
   than autograd would (RMSNorm, RoPE, the tiled MLP), and the recomputed block, whose kept tensors can live
   in pinned host memory (HostOffload). The whole life of a recomputed block is told once, in that section.
3. HF I/O: safetensors load and save in the layout transformers reads, and load_or_init_state_dict, the one
   place where weights are read or drawn.

The model never imports torch.distributed: attention is a function `attn_fn(q, k, v) -> out` it is given
(causal SDPA on one device, the ring of parallel.py under context parallelism); for a window of several documents,
`attn_fn(q, k, v, doc_lens)`.

    python -c "from model import *; m = Qwen3(Qwen3Config.tiny()); print(m(torch.zeros(1, 8, dtype=torch.long)).shape)"
"""
import dataclasses
import functools
import json
import math
import mmap
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from loss import addmm_fp32_, chunked_nll  # the tiled MLP's weight gradients share the loss's fp32 GEMM

HF_SHARD_BYTES = 5 * 2**30  # safetensors shard size of save_pretrained (transformers' default, 5 GiB)

# =============================================================================================
# 1. The plain Qwen3
# =============================================================================================


def refuse_unsupported(d: dict):
    """Stop on an HF config this trainer cannot train exactly: ring attention needs full causal attention
    in every layer."""
    where = d.get("_name_or_path", "config.json")
    if d.get("model_type") not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"{where}: model_type is {d.get('model_type')!r}; this trainer supports Qwen3 ('qwen3') "
                         "and Qwen3-MoE ('qwen3_moe') only (context parallelism needs full causal attention in "
                         "every layer).")
    experts = d.get("num_experts", d.get("num_local_experts"))
    if d["model_type"] == "qwen3" and experts:
        raise ValueError(f"{where}: num_experts in a 'qwen3' config, which transformers builds dense; a "
                         "mixture-of-experts model says model_type 'qwen3_moe'.")
    if d["model_type"] == "qwen3_moe" and experts is not None and not (
            0 < d.get("num_experts_per_tok", 8) <= experts and d.get("decoder_sparse_step", 1) >= 1):
        raise ValueError(f"{where}: a 'qwen3_moe' config needs num_experts >= num_experts_per_tok >= 1 and "
                         "decoder_sparse_step >= 1 (with no experts, use a dense 'qwen3' config).")
    if d.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is true; ring attention needs full causal attention "
                         "in every layer. Use a config with use_sliding_window: false.")
    bad_layers = sorted({t for t in d.get("layer_types") or [] if t != "full_attention"})
    if bad_layers:
        raise ValueError(f"{where}: layer_types has {bad_layers}; only 'full_attention' layers are supported.")
    if d.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias is true, which Qwen3 never uses; not supported.")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (Qwen3 uses 'silu').")


def parse_rope(d: dict) -> tuple[float, dict | None]:
    """-> (theta, YaRN scaling or None). Older configs say rope_theta + rope_scaling, newer ones
    rope_parameters (with theta inside)."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or d.get("rope_theta", 1e6)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{d.get('_name_or_path', 'config.json')}: rope type {rope_type!r} is not supported; "
                         "use 'default' or 'yarn'.")
    if rope_type == "default":
        return float(theta), None
    scaling = {k: rope[k] for k in ("factor", "original_max_position_embeddings", "attention_factor",
                                    "beta_fast", "beta_slow") if rope.get(k) is not None}
    scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return float(theta), scaling


@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # None (plain RoPE) or {"factor", "original_max_position_embeddings", optional "attention_factor",
    # "beta_fast", "beta_slow"} for YaRN
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    # Qwen3-MoE (model_type "qwen3_moe"); num_experts 0 is a dense Qwen3. Defaults: transformers' Qwen3MoeConfig
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)  # dense layers among the sparse ones
    output_router_logits: bool = False  # true: the loss adds router_aux_loss_coef x the load-balancing loss
    router_aux_loss_coef: float = 0.001
    raw: dict = field(default_factory=dict, repr=False)  # the config.json as read, written back on save

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        """An HF Qwen3 config.json dict (either RoPE style) -> Qwen3Config."""
        refuse_unsupported(d)
        theta, scaling = parse_rope(d)
        heads = d["num_attention_heads"]
        moe = {}
        if d["model_type"] == "qwen3_moe":  # transformers saves num_experts as num_local_experts; both are read
            moe = dict(num_experts=d.get("num_experts", d.get("num_local_experts", 128)),
                       **{k: d[k] for k in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                            "decoder_sparse_step", "output_router_logits", "router_aux_loss_coef")
                          if d.get(k) is not None},
                       mlp_only_layers=list(d.get("mlp_only_layers") or []))
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=d.get("tie_word_embeddings", False),
                   max_position_embeddings=d.get("max_position_embeddings", 40960),
                   initializer_range=d.get("initializer_range", 0.02), **moe, raw=dict(d))

    @classmethod
    def from_pretrained(cls, path: str) -> "Qwen3Config":
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no config.json in {path!r}: pass a folder holding an HF Qwen3 checkpoint "
                                    "(or only its config.json, to train from random initialisation).")
        try:
            with open(f) as fh:
                d = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not valid JSON ({e})") from None
        return cls.from_dict(d)

    @classmethod
    def tiny(cls, **kw) -> "Qwen3Config":
        """A small random Qwen3 for the demo and tests (vocab 257 = bytes + end-of-text)."""
        d = dict(model_type="qwen3", vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                 max_position_embeddings=4096, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
        d.update(kw)
        return cls.from_dict(d)

    def sparse(self, layer: int) -> bool:
        """Is this layer a mixture of experts? Exactly as transformers' Qwen3MoeDecoderLayer decides."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def yarn_scaled(self, factor: float, original_max_position_embeddings: int) -> "Qwen3Config":
        """A copy with YaRN at `factor` over `original_max_position_embeddings` positions (given explicitly,
        they win over the checkpoint's); theta and the checkpoint's beta_fast/beta_slow stay. The context it is
        for, factor x original, becomes max_position_embeddings, so that an export's config is consistent:
        transformers warns when max_position_embeddings / original differs from the factor."""
        old = self.rope_scaling or {}
        keep = {k: old[k] for k in ("beta_fast", "beta_slow") if k in old}
        original = int(original_max_position_embeddings)
        return dataclasses.replace(self, max_position_embeddings=round(factor * original), rope_scaling={
            "factor": float(factor), "original_max_position_embeddings": original, **keep})

    def to_dict(self) -> dict:
        """config.json for save_pretrained: the original fields, with the RoPE this run trained with."""
        d = dict(self.raw)
        d.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=self.vocab_size,
                 hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                 num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                 num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                 rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=self.tie_word_embeddings,
                 max_position_embeddings=self.max_position_embeddings, hidden_act="silu", attention_bias=False)
        rope = {"rope_type": "yarn", **self.rope_scaling} if self.rope_scaling else {"rope_type": "default"}
        if "rope_parameters" in d:  # keep the style the checkpoint came in
            d["rope_parameters"] = {**rope, "rope_theta": self.rope_theta}
        else:
            d["rope_theta"], d["rope_scaling"] = self.rope_theta, (rope if self.rope_scaling else None)
        if self.num_experts:
            d.pop("num_local_experts", None)  # one name for it: the hub's
            d.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers), output_router_logits=self.output_router_logits,
                     router_aux_loss_coef=self.router_aux_loss_coef)
        return d


# --- RoPE (default and YaRN, arXiv:2309.00071) -------------------------------------------------

def rope_inv_freq(cfg: Qwen3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float64) and the attention factor that scales cos and sin."""
    d, theta = cfg.head_dim, cfg.rope_theta
    inv_extrap = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    y = cfg.rope_scaling
    if not y:
        return inv_extrap, 1.0
    s, L0 = y["factor"], y["original_max_position_embeddings"]
    beta_fast, beta_slow = y.get("beta_fast", 32), y.get("beta_slow", 1)
    # Frequencies that turn fewer than beta_slow times over L0 are interpolated (divided by s); those that turn
    # more than beta_fast times are kept; a linear ramp in between.
    low = max(math.floor(d * math.log(L0 / (2 * math.pi * beta_fast)) / (2 * math.log(theta))), 0)
    high = min(math.ceil(d * math.log(L0 / (2 * math.pi * beta_slow)) / (2 * math.log(theta))), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_extrap / s * ramp + inv_extrap * (1 - ramp)
    attn_factor = y.get("attention_factor") or (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)
    return inv_freq, attn_factor


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attn_factor: float, dtype=torch.float32):
    """cos, sin [B, T, head_dim] (fp32, or float64 for a float64 model) for the positions present: never a
    table of max_positions x head_dim. Angles are formed in float64: at position 1,048,576 an fp32 product
    pos * inv_freq is off by up to 0.06 rad."""
    ang = position_ids.to(torch.float64)[..., None] * inv_freq.to(position_ids.device)  # [B, T, D/2]
    ang = torch.cat([ang, ang], dim=-1)                                                  # [B, T, D]
    return (ang.cos() * attn_factor).to(dtype), (ang.sin() * attn_factor).to(dtype)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, D]. HF's rotate-half layout, in x's dtype (as transformers does).
    [B, T, H, D] is the projection's own layout: every tensor here is contiguous, so each pass is one
    vectorised (on CUDA: one fused) kernel."""
    return _RoPE.apply(x, cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype))


# --- Layers ------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistics in fp32 (transformers' Qwen3RMSNorm)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


def causal_attention(q, k, v, doc_lens=None):
    """Default attn_fn: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D]; GQA without repeating K/V.
    doc_lens (lengths summing to T): a query sees only its own document's keys, through a [T, T] mask (one
    device, tests and short evaluation; the ring never builds one)."""
    if doc_lens is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if sum(doc_lens) != q.shape[2]:
        raise ValueError(f"doc_lens sum to {sum(doc_lens)}, not to the {q.shape[2]} tokens of the window")
    doc = torch.arange(len(doc_lens), device=q.device).repeat_interleave(torch.tensor(doc_lens, device=q.device))
    mask = (doc[:, None] == doc[None, :]).tril()  # [T, T]: same document, key not after query
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _docs(doc_lens):
    """The attention call's documents argument: (doc_lens,), or nothing for one sequence, so that an
    attn_fn(q, k, v) knowing no documents still serves plain windows."""
    return () if doc_lens is None else (doc_lens,)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.hq, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.hq * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend, doc_lens=None):
        """x [B, T, H] -> [B, T, H]. attend(q, k, v[, doc_lens]) -> out is the attention itself: the model's
        attn_fn, or one of the recomputed block's variants (section 2)."""
        B, T, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, self.hq, self.hd)), cos, sin)   # [B, T, Hq, D]
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, T, self.hkv, self.hd)), cos, sin)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.hkv, self.hd)                                     # [B, T, Hkv, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views as [B, H, T, D]: no copies
        o = attend(q, k, v, *_docs(doc_lens))                                                # [B, Hq, T, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.hq * self.hd))


def _swiglu(x, w_gate, w_up, w_down):
    return F.linear(fused(_silu_mul, x)(F.linear(x, w_gate), F.linear(x, w_up)), w_down)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.tile = 0  # rows per tile along the sequence (a memory lever, section 2); 0 = untiled

    def forward(self, x, value_is_read=True):
        """down(silu(gate(x)) * up(x)). value_is_read=False: only the output's gradient graph will be used
        (the recomputed block's backward), so the tiled MLP may skip computing its value."""
        ws = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if self.tile and x.shape[-2] > self.tile:
            return _TiledMLP.apply(x, self.tile, value_is_read, *ws)
        return _swiglu(x, *ws)


# --- Mixture of experts (Qwen3-MoE) ------------------------------------------------------------

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
    what the load-balancing loss needs (Qwen3.router_aux_loss)."""
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
        self.tile = 0  # rows per tile, as MLP.tile: routed and computed a tile at a time (section 2); 0 = untiled

    def forward(self, x, value_is_read=True):
        """x [B, T, H] -> (y [B, T, H], counts [E], prob_sums [E]) (moe_rows); value_is_read as for MLP."""
        rows = x.reshape(-1, x.shape[-1])                                        # [B*T, H]
        ws = (self.gate.weight, self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)
        with torch.profiler.record_function("moe"):  # named in profiles (bench/profile_step.py: "experts")
            if self.tile and rows.shape[0] > self.tile:
                y, counts, prob_sums = _TiledMoE.apply(rows, self.tile, value_is_read, self.top_k, self.norm_topk_prob,
                                                       *ws)
            else:
                y, counts, prob_sums = moe_rows(rows, *ws, self.top_k, self.norm_topk_prob)
        return y.view(x.shape), counts, prob_sums


class Block(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sparse = cfg.sparse(index)
        self.mlp = SparseMoE(cfg) if self.sparse else MLP(cfg)
        self.router_stats = self.sparse and cfg.output_router_logits  # hand the load-balancing loss its sums
        # memory levers (section 2), set by Qwen3.set_levers
        self.recompute = False       # keep only the block's input; recompute the rest in backward
        self.keep_attention = False  # ... and attention's output + lse, so the recompute skips attention
        self.offload = None          # a HostOffload (shared by the blocks) holding what is kept, or None

    def body(self, x, cos, sin, attend, mlp_value_is_read=True, doc_lens=None):
        """x [B, T, H] -> (y [B, T, H],) or, with router_stats, (y, counts [E], prob_sums [E]) (moe_rows): a flat
        tuple of tensors, so that the recomputed block can return it as its outputs."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, doc_lens)
        if not self.sparse:
            return (h + self.mlp(self.post_attention_layernorm(h), mlp_value_is_read),)
        y, counts, prob_sums = self.mlp(self.post_attention_layernorm(h), mlp_value_is_read)
        return (h + y, counts, prob_sums) if self.router_stats else (h + y,)

    def forward(self, x, cos, sin, attn_fn, doc_lens=None):
        """-> body's tuple."""
        if self.recompute and torch.is_grad_enabled():
            return _RecomputedBlock.apply(x, cos, sin, self, attn_fn, doc_lens)
        return self.body(x, cos, sin, attn_fn, doc_lens=doc_lens)


class Qwen3(nn.Module):
    def __init__(self, cfg: Qwen3Config, attn_fn=causal_attention, cp_sum=None):
        """cp_sum(t): sums a tensor in place over the ranks that hold parts of the same sequences (train.py: an
        all_reduce over the context-parallel group); None on one device. Only the load-balancing loss uses it."""
        super().__init__()
        self.cfg, self.attn_fn, self.cp_sum = cfg, attn_fn, cp_sum
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, labels=None, loss_chunk=2048, doc_lens=None):
        """input_ids [B, T] -> hidden [B, T, H] after the final norm; with labels [B, T], the chunked
        (loss_sum fp32, n_valid) instead, computed here so that FSDP2 gathers the head weight once per step.
        doc_lens: the window's documents (their lengths in order over the whole window, the same in every row;
        under context parallelism the global window, not this rank's shard): attention stays inside each. Then
        position_ids [B, T] must be given, each document's counting from 0 (zigzag-sharded like the tokens).
        A MoE with output_router_logits adds its load-balancing loss to loss_sum (router_aux_loss)."""
        B, T = input_ids.shape
        if doc_lens is not None and position_ids is None:
            raise ValueError("doc_lens needs position_ids: the positions inside each document, from 0")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        dtype = torch.promote_types(self.embed_tokens.weight.dtype, torch.float32)
        cos, sin = rope_cos_sin(position_ids, *rope_inv_freq(self.cfg), dtype)            # [B, T, D] fp32
        x = self.embed_tokens(input_ids)                                                  # [B, T, H]
        counts, prob_sums = [], []  # per sparse layer, with output_router_logits: [E] each (moe_rows)
        for block in self.layers:
            x, *stats = block(x, cos, sin, self.attn_fn, doc_lens)
            if stats:
                counts.append(stats[0])
                prob_sums.append(stats[1])
        h = self.norm(x)
        if labels is None:
            return h
        with torch.profiler.record_function("chunked_nll"):  # named in profiles (train.py --profile_step)
            out = chunked_nll(h.reshape(B * T, -1), self.head_weight(), labels.reshape(B * T), chunk_size=loss_chunk)
        if prob_sums:
            aux = self.router_aux_loss(torch.stack(counts).sum(0), torch.stack(prob_sums).sum(0), len(prob_sums),
                                       B * T, out.n_valid)
            out = dataclasses.replace(out, loss_sum=out.loss_sum + aux.to(out.loss_sum.dtype))
        return out

    def router_aux_loss(self, counts, prob_sums, layers: int, rows: int, n_valid):
        """router_aux_loss_coef x transformers' load_balancing_loss_func x the trained tokens, this rank's share:
        the loss is a sum that train.py divides by the trained-token count, and then this term adds exactly
        coef * aux to the mean, as transformers' outputs.loss has it.

        counts [E] (float64) and prob_sums [E] are summed over this rank's rows and the `layers` sparse layers.
        transformers' aux over all layers' rows (R of them, every token, trained or not) is
        E * sum_e (C_e / R) * (P_e / R), for the top-k counts C and probability sums P. The counts carry no
        gradient, so once C, R and the trained tokens are summed over the context-parallel group (cp_sum: one
        all-reduce of E + 2 numbers), each rank's E * sum_e C_e * P_e(this rank) / R^2 is an exact share of the
        sequence's aux, in value and in gradient: cp 2 or 4 gives what one process gives, up to rounding.
        Under data parallelism (or --grad_accum) each sequence has its own aux, weighted by its trained tokens.
        Two differences from transformers, both rounding only: the counts come from the routing's top-k of fp32
        probabilities (transformers takes top-k again of a softmax in the model's dtype, bf16 in training), and
        P sums fp32 probabilities."""
        E = self.cfg.num_experts
        totals = torch.cat([counts, counts.new_tensor([rows]), n_valid.reshape(1).to(counts.dtype)])  # [E + 2]
        if self.cp_sum is not None:
            self.cp_sum(totals)
        C, R, n = totals[:E], totals[E] * layers, totals[E + 1]
        share = ((E * C / R**2).to(prob_sums.dtype) * prob_sums).sum()
        return self.cfg.router_aux_loss_coef * n.to(share.dtype) * share

    def logits(self, input_ids, position_ids=None, doc_lens=None):
        """Full logits [B, T, V], for tests and short evaluation only."""
        return self(input_ids, position_ids, doc_lens=doc_lens) @ self.head_weight().T

    @torch.no_grad()
    def init_weights(self, generator=None):
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)

    def set_levers(self, recompute: bool = True, offload: bool = False, mlp_tile: int = 0,
                   offload_layers: int | None = None, keep_attention: bool = False,
                   keep_attention_layers: int | None = None):
        """The memory levers of section 2: recompute each block in backward from its kept input; keep
        attention's output + lse too (keep_attention); hold what is kept in pinned host memory (offload); compute
        the MLP in tiles of mlp_tile rows (0 = off). offload_layers and keep_attention_layers limit those two
        levers to the first N blocks (None = every block, 0 = none): the first blocks' tensors are needed last
        in backward, so their copies hide best. Offload implies recompute."""
        L = len(self.layers)
        n = (L if offload_layers is None else offload_layers) if offload else 0
        k = (L if keep_attention_layers is None else keep_attention_layers) if keep_attention else 0
        shared = HostOffload() if n else None
        for b in self.layers:
            b.recompute, b.offload, b.mlp.tile = recompute or n > 0, shared if b.index < n else None, mlp_tile
            b.keep_attention = b.index < k
        return self

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, dtype=torch.bfloat16, device="cpu", attn_fn=causal_attention,
                        seed: int = 0):
        """An HF Qwen3 folder or hub id -> the model in dtype on device; a folder with only a config.json gives
        weights drawn from `seed` (load_or_init_state_dict)."""
        path = local_folder(path_or_hub_id)
        cfg = Qwen3Config.from_pretrained(path)
        with torch.device("meta"):
            model = cls(cfg, attn_fn)
        sd = load_or_init_state_dict(path, cfg, list(model.state_dict()), dtype, seed, device)
        model.load_state_dict({n: t.to(device) for n, t in sd.items()}, assign=True)
        return model

    def save_pretrained(self, out_dir: str, state_dict=None, max_shard_bytes: int = HF_SHARD_BYTES):
        save_hf(out_dir, self.cfg, state_dict if state_dict is not None else self.state_dict(), max_shard_bytes)


# =============================================================================================
# 2. Memory levers
# =============================================================================================
#
# The life of a recomputed block (Block.recompute; train.py --recompute), told once.
#
# Forward (_RecomputedBlock.forward, under no_grad): the block keeps only its input x [B, T, H]. With
# keep_attention, attention also hands back its output and log-sum-exp through attn_fn.fwd(q, k, v) ->
# (out [B, Hq, T, D], lse [B, Hq, T] fp32) (_KeptAttention): attention is most of a block's cost at long
# sequence, and these two let backward skip it. What is kept goes to pinned host memory when the block has an
# offload (HostOffload), else it stays on the GPU.
#
# Backward (_RecomputedBlock.backward): the kept tensors come back (the offload brings block i-1's while block
# i runs), and the block runs again with grad on, to rebuild its graph:
#   - attention: without kept tensors, attn_fn runs forward again; with them, _ReplayAttention returns the kept
#     output as is and, in its backward, calls attn_fn.bwd(dout, q, k, v, out, lse) -> (dq, dk, dv). For the
#     ring (parallel.RingAttention), fwd/bwd are its two halves without autograd. A window of documents adds
#     doc_lens to each of these calls (the block keeps it for its backward).
#   - MLP: the recomputed output's value is never read (only its gradient graph is), so the tiled MLP skips
#     its forward (mlp_value_is_read=False): its own backward recomputes each tile anyway.
# Then autograd runs the rebuilt graph backward from the block's output gradient (and, for a MoE block under the
# load-balancing loss, from the gradient of its router's probability sums, a second output of the block). The
# block's parameters are not inputs of _RecomputedBlock: this inner backward accumulates their gradients (as
# reentrant checkpointing does), and FSDP2's post-backward hook reduce-scatters them.


class _KeptAttention:
    """attend(q, k, v[, doc_lens]) for the recomputed block's forward with keep_attention: runs attn_fn.fwd and
    keeps its (out, lse) as attributes for the block to save."""

    def __init__(self, attn_fn):
        self.attn_fn, self.out, self.lse = attn_fn, None, None

    def __call__(self, q, k, v, *docs):
        self.out, self.lse = self.attn_fn.fwd(q, k, v, *docs)
        return self.out


class _ReplayAttention(torch.autograd.Function):
    """Attention whose output is already known (kept from the forward pass): returns it, and in backward runs
    the attention backward from the recomputed q, k, v and the kept output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, attn_fn, docs):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn_fn, ctx.docs = attn_fn, docs
        return out.view_as(out)  # out was made under no_grad; this node becomes its grad_fn

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return *ctx.attn_fn.bwd(dout, q, k, v, out, lse, *ctx.docs), None, None, None, None


def _replay_attention(q, k, v, *docs, out, lse, attn_fn):
    return _ReplayAttention.apply(q, k, v, out, lse, attn_fn, docs)


class _RecomputedBlock(torch.autograd.Function):
    """A block that keeps only its input (and, with keep_attention, attention's output and lse), and
    recomputes the rest in backward: the story is told at the top of this section."""

    @staticmethod
    def forward(ctx, x, cos, sin, block, attn_fn, doc_lens):
        ctx.block, ctx.attn_fn, ctx.doc_lens = block, attn_fn, doc_lens
        attend = _KeptAttention(attn_fn) if block.keep_attention and hasattr(attn_fn, "fwd") else attn_fn
        with torch.no_grad():
            y, *stats = block.body(x, cos, sin, attend, doc_lens=doc_lens)
        if stats:  # the router's counts are integers (no gradient); its probability sums carry one
            ctx.mark_non_differentiable(stats[0])
        kept = {"x": x}
        if isinstance(attend, _KeptAttention):
            kept.update(out=attend.out, lse=attend.lse)
        ctx.names = list(kept)
        if block.offload is not None:
            for name, t in kept.items():
                block.offload.save((block.index, name), t)
            kept = {}
        ctx.save_for_backward(cos, sin, *kept.values())
        return y, *stats

    @staticmethod
    def backward(ctx, dy, *dstats):
        block = ctx.block
        cos, sin, *kept = ctx.saved_tensors
        if block.offload is not None:
            kept = [block.offload.load((block.index, name), dy.device) for name in ctx.names]
        kept = dict(zip(ctx.names, kept))
        attend = ctx.attn_fn
        if "out" in kept:  # the kept output stands in for attention's forward; its backward runs attn_fn.bwd
            attend = functools.partial(_replay_attention, out=kept["out"], lse=kept["lse"], attn_fn=ctx.attn_fn)
        with torch.enable_grad():
            x = kept["x"].detach().requires_grad_()
            y, *stats = block.body(x, cos, sin, attend, mlp_value_is_read=False, doc_lens=ctx.doc_lens)
            # with router stats, the load-balancing loss's gradient enters through the probability sums
            torch.autograd.backward([y, *stats[1:]], [dy, *dstats[1:]])
        return x.grad, None, None, None, None, None


class HostOffload:
    """What the recomputed blocks keep (inputs, attention outputs), in pinned host memory between forward and
    backward, under keys (block index, name).

    Forward: the device->host copy runs on a side stream, overlapping the next block's compute. Backward: block
    i-1's tensors come back while block i recomputes and runs backward. The pinned buffers are reused from step
    to step, each exactly its tensor's size (pinned_empty_like). On CPU it still copies, so the CPU tests run the
    same code."""

    def __init__(self):
        self.host = {}       # (block index, name) -> pinned host buffer
        self.pinned = {}     # (block index, name) -> its HostRegistration (CUDA only)
        self.on_device = {}  # (block index, name) -> (tensor, event) brought back ahead of its backward
        self.copied = {}     # block index -> event after its last device->host copy
        self.stream = None

    def _side_stream(self, device):
        if device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def save(self, key, x):
        buf = self.host.get(key)
        if buf is None or buf.shape != x.shape or buf.stride() != x.stride() or buf.dtype != x.dtype:
            # x's own memory layout (e.g. attention output in [B, T, H, D] order seen as [B, H, T, D]): the copy
            # is then one flat transfer, with no contiguous temporary on the GPU
            if key in self.pinned:  # no copy may still read the old buffer when its pages are released
                torch.cuda.synchronize(x.device)
                del self.pinned[key]
            if x.is_cuda:
                buf, self.pinned[key] = pinned_empty_like(x)
            else:
                buf = torch.empty_like(x, device="cpu")
            self.host[key] = buf
        stream = self._side_stream(x.device)
        if stream is None:
            buf.copy_(x)
            return
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            buf.copy_(x, non_blocking=True)
            self.copied[key[0]] = stream.record_event()
        x.record_stream(stream)  # the allocator must not hand x's memory out before the copy has read it
        # Wait for the copies two blocks back, else the CPU runs ahead and freed tensors pile up (bench/NOTES.md, v5)
        earlier = self.copied.pop(key[0] - 2, None)
        if earlier is not None:
            earlier.synchronize()

    def _fetch(self, key, device):
        buf = self.host[key]
        stream = self._side_stream(device)
        if stream is None:
            return buf.clone(), None
        # Allocated on the compute stream: reused in its order, however far the CPU runs ahead (bench/NOTES.md, v4)
        x = torch.empty_like(buf, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            x.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return x, event

    def load(self, key, device):
        x, event = self.on_device.pop(key, None) or self._fetch(key, device)
        ahead = (key[0] - 1, key[1])  # backward runs the blocks in reverse order
        if ahead in self.host and ahead not in self.on_device:
            self.on_device[ahead] = self._fetch(ahead, device)
        if event is not None:  # the compute stream waits for the copy before any use (or free) of x
            torch.cuda.current_stream(device).wait_event(event)
        return x

    def host_bytes(self):
        """Host memory the buffers take: pinned ones in whole pages (pinned_size)."""
        return sum((pinned_size if k in self.pinned else int)(b.numel() * b.element_size())
                   for k, b in self.host.items())


def pinned_size(nbytes: int) -> int:
    """Host memory that pinned_empty_like page-locks for nbytes: whole pages. (torch's pinned allocator,
    CachingHostAllocator, would round each buffer up to a power of two: a 0.625 GiB block input, Qwen3-4B's at
    131k tokens, would take 1 GiB.)"""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class HostRegistration:
    """Ordinary host memory of pinned_size(nbytes), starting on a page, page-locked with cudaHostRegister for as
    long as this object lives (so that copies to and from it run asynchronously)."""

    def __init__(self, nbytes: int):
        self.raw = torch.empty(pinned_size(nbytes) + mmap.PAGESIZE, dtype=torch.uint8)  # room to start on a page
        self.offset = -self.raw.data_ptr() % mmap.PAGESIZE
        self.ptr = self.raw.data_ptr() + self.offset if nbytes else None
        error = int(torch.cuda.cudart().cudaHostRegister(self.ptr, pinned_size(nbytes), 0)) if nbytes else 0
        if error:
            self.ptr = None
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {error})")

    def __del__(self):
        if getattr(self, "ptr", None) is not None:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)


def pinned_empty_like(x: torch.Tensor) -> tuple[torch.Tensor, HostRegistration]:
    """An uninitialised host tensor like x (x's strides, as torch.empty_like keeps them) in page-locked memory of
    exactly its size, and the registration that keeps it pinned: the tensor is pinned while both live."""
    like = torch.empty_like(x, device="meta")  # the layout empty_like picks, no memory
    nbytes = x.numel() * x.element_size()
    reg = HostRegistration(nbytes)
    flat = reg.raw[reg.offset:reg.offset + nbytes].view(x.dtype)
    return flat.as_strided(like.shape, like.stride()), reg


# --- Functions that keep less than autograd would --------------------------------------------

@functools.cache
def _compiled(fn):
    return torch.compile(fn)


def fused(fn, x):
    """fn compiled by torch.compile (one Triton kernel for a chain of elementwise ops and reductions) when x is
    on CUDA; fn itself elsewhere, so the CPU tests check the same formulas eagerly."""
    return _compiled(fn) if x.is_cuda else fn


def _rms_norm(x, w, eps):
    rstd = torch.rsqrt(x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True) + eps)
    return w * (x.to(rstd.dtype) * rstd).to(x.dtype), rstd


def _rms_norm_backward(dy, x, w, rstd):
    acc = rstd.dtype
    n = x.to(acc) * rstd                                    # the normalised x
    dw = (dy.to(acc) * n.to(x.dtype).to(acc)).reshape(-1, n.shape[-1]).sum(0)
    dn = (dy * w).to(acc)
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw.to(w.dtype)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm keeping only x and rstd for backward. Autograd of the same formula keeps fp32 copies of x
    (1.25 GiB each for a 131k x 2560 input, Qwen3-4B's width): 4.4 GiB off the Qwen3-4B/131k peak (bench/NOTES.md)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = fused(_rms_norm, x)(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = fused(_rms_norm_backward, dy)(dy, x, w, rstd)
        return dx, dw, None


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class _RoPE(torch.autograd.Function):
    """y = x*cos + rotate_half(x)*sin. rotate_half is a rotation by 90 degrees and sin is the same in both
    halves, so the backward is the rotation the other way: dx = rope(dy, cos, -sin). Keeps only cos/sin."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return fused(_rope, x)(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return fused(_rope, dy)(dy, cos, -sin), None, None


def _silu_mul(g, u):
    return F.silu(g) * u


def _silu_mul_backward(dh, g, u):
    """Gradients of h = silu(g) * u, in fp32 and rounded once: silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g)."""
    acc = torch.promote_types(dh.dtype, torch.float32)
    dh, gf, uf = dh.to(acc), g.to(acc), u.to(acc)
    s = torch.sigmoid(gf)
    return (dh * uf * s * (1 + gf * (1 - s))).to(g.dtype), (dh * gf * s).to(u.dtype)


class _TiledMLP(torch.autograd.Function):
    """SwiGLU over tiles of rows (tokens), each tile's forward and backward on its own, so the four
    [T, intermediate] tensors exist one tile at a time (at 1M tokens and Qwen3-8B's intermediate 12,288 they
    are 96 GiB whole in bf16). The backward is written out: per tile, the recomputed gate/up, one fused kernel
    for the SwiGLU gradient, and the weight gradients added by the GEMMs straight into fp32 buffers, rounded
    once."""

    @staticmethod
    def forward(ctx, x, tile, value_is_read, w_gate, w_up, w_down):
        ctx.tile = tile
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        if not value_is_read:  # a recomputed block's backward: only the graph is used, and backward below
            return x.new_empty(x.shape)  # recomputes per tile anyway. Uninitialised: never read
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([_swiglu(xt, w_gate, w_up, w_down) for xt in rows.split(tile)]).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, wg, wu, wd = ctx.saved_tensors
        rows, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, x.shape[-1])
        dx = torch.empty_like(rows)
        dwg, dwu, dwd = (torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32)) for w in (wg, wu, wd))
        for xt, dyt, dxt in zip(rows.split(ctx.tile), dy.split(ctx.tile), dx.split(ctx.tile)):
            g, u = F.linear(xt, wg), F.linear(xt, wu)                        # [t, I]
            addmm_fp32_(dwd, dyt.T, fused(_silu_mul, g)(g, u))               # dW_down += dy^T h
            dg, du = fused(_silu_mul_backward, g)(dyt @ wd, g, u)            # dh = dy W_down
            torch.mm(dg, wg, out=dxt)
            dxt.addmm_(du, wu)                                               # dx = dg W_gate + du W_up
            addmm_fp32_(dwg, dg.T, xt)
            addmm_fp32_(dwu, du.T, xt)
        return dx.view(x.shape), None, None, dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype)


class _TiledMoE(torch.autograd.Function):
    """The MoE block over tiles of rows, as _TiledMLP: each tile routed and computed on its own, forward and
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


# =============================================================================================
# 3. HF I/O
# =============================================================================================

def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def hf_names(name: str, num_experts: int) -> list[str]:
    """Our parameter name -> its tensors' names in an HF checkpoint: one, or for stacked expert weights
    (layers.N.mlp.experts.gate_proj [E, I, H]) the hub's one per expert (model.layers.N.mlp.experts.E.gate_proj
    .weight), the layout every transformers version loads (5.x fuses them on load, and splits them on save)."""
    module, _, weight = name.rpartition(".")
    if module.endswith(".mlp.experts"):
        return [f"model.{module}.{e}.{weight}.weight" for e in range(num_experts)]
    return [hf_name(name)]


def local_folder(path_or_hub_id: str) -> str:
    """A local folder as is; otherwise a hub id fetched with snapshot_download (config, weights, tokenizer)."""
    if os.path.isdir(path_or_hub_id):
        return path_or_hub_id
    looks_local = path_or_hub_id.startswith((".", "/", "~")) or path_or_hub_id.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"{path_or_hub_id!r}: no such folder, and not a hub id of the form 'org/name'. "
                                "Pass a folder with config.json (+ *.safetensors) or a hub id such as Qwen/Qwen3-8B.")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(path_or_hub_id, allow_patterns=["config.json", "*.safetensors", "*.json",
                                                                 "tokenizer*", "*.txt"])
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        raise ConnectionError(f"could not download {path_or_hub_id!r} from the Hugging Face hub ({type(e).__name__}: "
                              f"{e}). Check the network and HF_TOKEN, or download it elsewhere and pass the local "
                              "folder instead.") from e


def load_hf_state_dict(path: str, names: list[str], dtype, num_experts: int = 0) -> dict | None:
    """Our parameter names -> tensors from (possibly sharded) safetensors, the experts' stacked; None when the
    folder has none."""
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    tensors = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for k in st.keys():
                tensors[k] = st.get_tensor(k)
    want = {n: hf_names(n, num_experts) for n in names}
    missing = sorted(h for hs in want.values() for h in hs if h not in tensors)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    extra = sorted(set(tensors) - {h for hs in want.values() for h in hs} - {"lm_head.weight"})  # tied models may
    if extra:                                                                                 # still carry a head
        raise ValueError(f"{path}: checkpoint has weights this Qwen3 does not, e.g. {extra[:3]}")
    # each tensor read is dropped once used: the stacked experts do not hold a second copy of the checkpoint
    return {n: (torch.stack([tensors.pop(h) for h in hs]) if len(hs) > 1 else tensors.pop(hs[0])).to(dtype)
            for n, hs in want.items()}


def load_or_init_state_dict(path: str | None, mcfg: Qwen3Config, names: list[str], dtype, seed: int,
                            device) -> dict:
    """The full state dict {name: tensor in dtype}: read from path's *.safetensors (on the CPU), or drawn on
    `device` by init_weights from `seed` where there are none (path None, or a folder with only a config.json,
    with a warning). The draw is the same for any world size: runs at different cp agree on it."""
    sd = load_hf_state_dict(path, names, dtype, mcfg.num_experts) if path else None
    if sd is not None:
        return sd
    if path:
        warnings.warn(f"{path} has a config.json but no *.safetensors: random initialisation")
    with torch.device(device):
        ref = Qwen3(mcfg).to(dtype)
    ref.init_weights(torch.Generator(device).manual_seed(seed))
    return ref.state_dict()


def save_hf(out_dir: str, cfg: Qwen3Config, state_dict: dict, max_shard_bytes: int = HF_SHARD_BYTES):
    """config.json + safetensors shards (+ index when sharded) that transformers loads as Qwen3ForCausalLM (or
    Qwen3MoeForCausalLM, the experts one tensor each, as on the hub)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for n, t in state_dict.items():
        t, hs = t.detach().cpu(), hf_names(n, cfg.num_experts)
        # an expert's slice is cloned: safetensors refuses tensors that share memory
        tensors.update({hs[0]: t.contiguous()} if len(hs) == 1 else {h: t[e].clone() for e, h in enumerate(hs)})
    shards, size = [{}], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k], size = t, size + nbytes
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    umask = os.umask(0o022)
    os.umask(umask)
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)  # safetensors writes 0600: others could not read it
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({**cfg.to_dict(), "torch_dtype": dtype, "dtype": dtype}, fh, indent=2)
