"""Qwen3.5's text decoder, an extension of model.py: a hybrid of Gated DeltaNet layers (linear attention, deltanet.py)
and gated full-attention layers (every 4th by default), with zero-centred RMSNorm. It reads like transformers'
modeling_qwen3_5.py (same names, so state dicts convert 1:1) and is checked against it (tests/test_qwen3_5.py).

As model.Qwen3, the model never imports torch.distributed: the attention layers call `attn_fn(q, k, v[, doc_lens])`
(the ring of parallel.py under context parallelism) and the DeltaNet layers call `mixer` (a deltanet.DeltaNetMixer,
holding the cp group). Text only: with text positions M-RoPE's three sections (t, h, w) carry the same position,
which is plain RoPE on the rotary part of each head. Also here: the HF config.json (qwen3_5_text, or the
vision-language qwen3_5 whose text_config is this decoder) and safetensors in and out; a composite checkpoint's
other weights (vision tower, MTP head) pass through a save unchanged. Qwen3.5-MoE (qwen3_5_moe, qwen3_5_moe_text) is
the same decoder with moe.py's experts and a shared expert in every layer's place of the MLP (Qwen3_5Moe).

    python -c "from million.qwen3_5 import *; print(Qwen3_5(Qwen3_5Config.tiny())(torch.zeros(1, 8).long()).shape)"
    python -m pytest tests/test_qwen3_5.py -q
"""
import dataclasses
import functools
import itertools
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loss import chunked_nll
from model import Block as Qwen3Block
from model import MLP, Qwen3, Qwen3Config, apply_rope, causal_attention, fused, rope_cos_sin, rope_inv_freq
from million import deltanet, moe
from million.deltanet import DeltaNetMixer, causal_conv, resolve_kernel
from million.hf_files import HF_SHARD_BYTES, parse_rope, read_safetensors, write_safetensors

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5Config:
    """The text decoder's shape; defaults are transformers' Qwen3_5TextConfig (the 9B)."""
    model_type: ClassVar[str] = "qwen3_5"  # what train.py and hf.py tell this family by (not a field)
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    layer_types: list = None  # per layer, "linear_attention" or "full_attention"; None: every 4th full
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    partial_rotary_factor: float = 0.25  # RoPE turns the first quarter of each head
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # None or YaRN, as model.Qwen3Config's
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    raw: dict = field(default_factory=dict, repr=False)  # the config.json as read (composite or text), for a save
    source: str | None = None  # the folder read: a save copies its weights outside the text decoder from there

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} per layer ({self.num_hidden_layers}); "
                             f"got {len(self.layer_types)} entries{', unknown ' + str(bad) if bad else ''}")
        for many, few in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
            if getattr(self, many) % getattr(self, few):
                raise ValueError(f"{many} {getattr(self, many)} is not a multiple of {few} {getattr(self, few)}: "
                                 "the heads are shared in whole groups")

    def yarn_scaled(self, factor: float, original: int) -> "Qwen3_5Config":
        """--yarn_factor as for Qwen3 (model.Qwen3Config.yarn_scaled: max_position_embeddings and rope_scaling
        replaced), refused from below the context this model was trained to: the flags' defaults are Qwen3's (32
        over 32,768), and YaRN from 32,768 would squeeze positions a Qwen3.5 knows (262,144 in its config.json)."""
        native = (self.rope_scaling or {}).get("original_max_position_embeddings", self.max_position_embeddings)
        if original < native:
            raise ValueError(
                f"--yarn_original_max_position_embeddings {original} is below the {native:,} tokens this Qwen3.5 "
                f"was trained to (its config.json): YaRN from there would squeeze positions it knows. Pass "
                f"--yarn_factor {max(1.0, 1_048_576 / native):g} --yarn_original_max_position_embeddings {native} "
                f"(to {max(native, 1_048_576):,} tokens; the factor scales with the length), or --yarn_factor 0 "
                f"up to {native:,}")
        return Qwen3Config.yarn_scaled(self, factor, original)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:  # a DeltaNet layer's conv channels: [q | k | v]
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def tiny(cls, **kw) -> "Qwen3_5Config":
        """Small and awkward, for tests: 3 DeltaNet layers and 1 attention layer, 5 query heads on 1 KV head, 3 key
        heads serving 6 value heads, dk != dv, vocabulary 257."""
        return dataclasses.replace(cls(
            vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=5,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=3, linear_num_value_heads=6,
            linear_key_head_dim=12, linear_value_head_dim=10, max_position_embeddings=4096), **kw)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Qwen3_5Config":
        """An HF config.json dict: model_type 'qwen3_5_text', or 'qwen3_5' (a vision-language model; its
        text_config is what is trained here); 'qwen3_5_moe_text' or 'qwen3_5_moe' give a Qwen3_5MoeConfig."""
        kind = d.get("model_type")
        if kind not in KINDS:
            raise ValueError(f"{d.get('_name_or_path', 'config.json')}: model_type {kind!r} is not Qwen3.5; "
                             "supported: 'qwen3_5' (its text_config), 'qwen3_5_text', 'qwen3_5_moe' (its text_config) "
                             "and 'qwen3_5_moe_text'.")
        if "moe" in kind and not issubclass(cls, Qwen3_5MoeConfig):
            return Qwen3_5MoeConfig.from_hf_dict(d)
        t = (d.get("text_config") or {}) if kind in COMPOSITE else d
        if t.get("hidden_act", "silu") != "silu" or t.get("attention_bias"):
            raise ValueError("Qwen3.5 with hidden_act other than silu or with attention_bias is not supported")
        theta, scaling = parse_rope(t)
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("raw", "source", "rope_theta",
                                                                            "rope_scaling", "layer_types")]
        kw = {n: t[n] for n in names if t.get(n) is not None}
        experts, top_k = kw.get("num_experts", 1), kw.get("num_experts_per_tok", 1)
        if "moe" in kind and not 1 <= top_k <= experts:
            raise ValueError(f"{d.get('_name_or_path', 'config.json')}: Qwen3.5-MoE needs num_experts >= "
                             f"num_experts_per_tok >= 1, got {experts} and {top_k}")
        kw["partial_rotary_factor"] = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        kw.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        n = kw.get("num_hidden_layers", cls.num_hidden_layers)
        every = t.get("full_attention_interval", 4)
        types = t.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                         for i in range(n)]
        return cls(**kw, layer_types=list(types), rope_theta=theta, rope_scaling=scaling, raw=dict(d))

    def to_hf_dict(self) -> dict:
        """config.json for a save: the dict read (composite or text) with this shape and RoPE written in."""
        moe_ = "_moe" if isinstance(self, Qwen3_5MoeConfig) else ""
        d = json.loads(json.dumps(self.raw)) if self.raw else {"model_type": f"qwen3_5{moe_}_text"}
        composite = d["model_type"] in COMPOSITE
        t = d.setdefault("text_config", {}) if composite else d
        t.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("raw", "source", "rope_theta", "rope_scaling", "partial_rotary_factor")
                  and not (moe_ and f.name == "intermediate_size")},  # Qwen3.5-MoE has no dense MLP
                 layer_types=list(self.layer_types), hidden_act="silu", attention_bias=False)
        old = t.pop("rope_scaling", None) or t.get("rope_parameters") or {}
        rope = {k: v for k, v in old.items() if k in ("mrope_section", "mrope_interleaved")}
        rope.update(self.rope_scaling or {}, rope_type="yarn" if self.rope_scaling else "default",
                    rope_theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor)
        t["rope_parameters"] = rope
        t.pop("rope_theta", None)
        t.pop("partial_rotary_factor", None)
        if composite:
            t["model_type"] = f"qwen3_5{moe_}_text"
            d["tie_word_embeddings"] = self.tie_word_embeddings
        arch = "Qwen3_5Moe" if moe_ else "Qwen3_5"
        d["architectures"] = [f"{arch}ForConditionalGeneration" if composite else f"{arch}ForCausalLM"]
        return d


@dataclass
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Qwen3.5-MoE's text decoder: Qwen3_5Config's fields and those of transformers' Qwen3_5MoeTextConfig, with its
    defaults (the 35B-A3B). Every layer's MLP is a mixture of experts with a shared expert (moe.SharedExpertMoE);
    intermediate_size is unused."""
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    output_router_logits: bool = False  # true: router_aux_loss_coef x the load-balancing loss joins the objective
    router_aux_loss_coef: float = 0.001
    norm_topk_prob: ClassVar[bool] = True  # the router renormalises its top-k weights, always

    def sparse(self, layer: int) -> bool:  # (as moe.Qwen3MoeConfig.sparse): every layer is
        return True

    @classmethod
    def tiny(cls, **kw) -> "Qwen3_5MoeConfig":
        """Qwen3_5Config.tiny with 7 experts of width 24, top 3, a shared expert of width 40."""
        return dataclasses.replace(super().tiny(), num_experts=7, num_experts_per_tok=3, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=40, **kw)


COMPOSITE = ("qwen3_5", "qwen3_5_moe")  # vision-language configs whose text_config is the decoder trained here
KINDS = COMPOSITE + ("qwen3_5_text", "qwen3_5_moe_text")


def read_config(folder: str) -> Qwen3_5Config:
    with open(os.path.join(folder, "config.json")) as fh:
        return dataclasses.replace(Qwen3_5Config.from_hf_dict(json.load(fh)), source=folder)


# --- Layers ------------------------------------------------------------------------------------

class ZeroCentredRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + w), w starting at 0 (transformers' Qwen3_5RMSNorm), in fp32 (or wider), rounded once."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        return _NormFn.apply(_zc_norm, _zc_norm_backward, self.eps, x, self.weight)


class GatedRMSNorm(nn.Module):
    """y = w * x / rms(x) * silu(z) (transformers' Qwen3_5RMSNormGated: a plain weight, starting at 1)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x, z):
        return _NormFn.apply(_gated_norm, _gated_norm_backward, self.eps, x, z, self.weight)


class _NormFn(torch.autograd.Function):
    """A norm that keeps only its inputs and the fp32 rstd for the backward, each direction one compiled kernel on
    CUDA (model.fused), where autograd of the same formula would keep fp32 copies of x (and z) and run a dozen
    elementwise kernels over [tokens, hidden] each way. formula(*inputs, eps) -> (y, rstd); backward(dy, *inputs,
    rstd) -> the inputs' gradients. The formulas below round where transformers' do."""

    @staticmethod
    def forward(ctx, formula, backward, eps, *inputs):
        y, rstd = fused(formula, inputs[0])(*inputs, eps)
        ctx.backward = backward
        ctx.save_for_backward(*inputs, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        return None, None, None, *fused(ctx.backward, dy)(dy, *ctx.saved_tensors)


def _zc_norm(x, w, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * (1 + w.to(xf.dtype))).to(x.dtype), rstd


def _zc_norm_backward(dy, x, w, rstd):
    n = x.to(rstd.dtype) * rstd                                         # the normalised x, fp32
    g = dy.to(rstd.dtype)
    dw = (g * n).reshape(-1, n.shape[-1]).sum(0)
    dn = g * (1 + w.to(rstd.dtype))
    return (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype), dw.to(w.dtype)


def _gated_norm(x, z, w, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((w * (xf * rstd).to(x.dtype)) * F.silu(z.to(xf.dtype))).to(x.dtype), rstd


def _gated_norm_backward(dy, x, z, w, rstd):
    acc = rstd.dtype
    n = x.to(acc) * rstd                                                # the normalised x, fp32
    a = n.to(x.dtype)                                                   # ... rounded, as the forward multiplies it
    zf = z.to(acc)
    s = torch.sigmoid(zf)
    g = dy.to(acc)
    db = g * zf * s                                                     # d(w * a): dy * silu(z)
    dz = g * (w * a).to(acc) * s * (1 + zf * (1 - s))                   # silu'(z) = s (1 + z (1 - s))
    dw = (db * a.to(acc)).reshape(-1, n.shape[-1]).sum(0)
    dn = db * w.to(acc)
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dz.to(z.dtype), dw.to(w.dtype)


def partial_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, rotary_dim]: RoPE on the first rotary_dim of each head, the rest as is."""
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class GatedAttention(nn.Module):
    """Causal attention (GQA, q/k norm, partial RoPE) whose output is gated per channel by sigmoid of a second half
    of q_proj: q_proj gives, per head, head_dim query channels then head_dim gate channels."""

    def __init__(self, cfg: Qwen3_5Config):
        super().__init__()
        self.hq, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.hd * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.hq * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCentredRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend, doc_lens=None):
        """x [B, T, H] -> [B, T, H]; attend(q, k, v[, doc_lens]) on [B, heads, T, D], as model.Attention calls it."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.hq, 2, self.hd).unbind(3)                   # [B, T, Hq, D] each
        # both halves copied out of q_proj's output at once, which is then freed: q_norm keeps its input, and a
        # view of q would keep the whole output (Hq x D a token more, 4 GiB at 524,288 tokens at the 9B's heads)
        q, gate = q.contiguous(), gate.contiguous()
        q = partial_rope(self.q_norm(q), cos, sin)                                            # [B, T, Hq, D]
        k = partial_rope(self.k_norm(self.k_proj(x).view(B, T, self.hkv, self.hd)), cos, sin)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.hkv, self.hd)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *(() if doc_lens is None else (doc_lens,)))
        o = o.transpose(1, 2).reshape(B, T, self.hq * self.hd)                                # [B, T, Hq * D]
        # sigmoid after attention, so that its backward (and the output it keeps) comes before attention's
        return self.o_proj(o * torch.sigmoid(gate).reshape(B, T, -1))


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule (arXiv:2412.06464). Projections, then a causal depthwise conv with
    SiLU over [q | k | v], L2-normalised q and k, a decay g and a write strength beta per value head and token, the
    recurrence (deltanet.py), a gated RMSNorm with z, out_proj. Each key head serves value heads / key heads
    consecutive value heads."""

    def __init__(self, cfg: Qwen3_5Config):
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = cfg.linear_conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.nv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.nv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, cfg.hidden_size, bias=False)
        self.tile = 0  # the lever deltanet_tile: tokens per piece (0: the whole sequence at once)

    def forward(self, x, mixer, doc_lens=None):
        """x [B, T, H] -> [B, T, H]; mixer: deltanet.DeltaNetMixer (one device or a cp group)."""
        if self.tile and x.shape[1] > self.tile:
            return self._tiled(x, mixer, doc_lens)
        y = mixer.conv(self.in_proj_qkv(x), self.conv1d.weight, doc_lens)                   # [B, T, conv_dim]
        o = mixer.rule(*self._rule_inputs(x, y), doc_lens)                                  # [B, T, nv, dv]
        return self._output(x, o)

    def _rule_inputs(self, x, y):
        """The conv's output y (after SiLU) -> the rule's q, k [B, T, nk, dk] (views: the rule normalises them), v
        [B, T, nv, dv], the log decay g = -exp(A_log) softplus(a + dt_bias) in fp32 (or wider) and beta = sigmoid(b)
        [B, T, nv]."""
        q, k, v = y.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], -1)
        wide = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias)
        return (q.unflatten(-1, (self.nk, self.dk)), k.unflatten(-1, (self.nk, self.dk)),
                v.unflatten(-1, (self.nv, self.dv)), g, self.in_proj_b(x).sigmoid())

    def _output(self, x, o):
        """The rule's output o [B, T, nv, dv] -> the gated norm with z, out_proj -> [B, T, H]."""
        B, T, _ = x.shape
        o = self.norm(o.to(x.dtype), self.in_proj_z(x).view(B, T, self.nv, self.dv))
        return self.out_proj(o.reshape(B, T, self.nv * self.dv))

    def _tiled(self, x, mixer, doc_lens):
        """The lever deltanet_tile (one device): the layer over pieces of at most `tile` tokens, each under
        activation checkpointing, the state and the conv's last K - 1 inputs carried from piece to piece and reset
        at each document's start. The backward then holds one piece's intermediates (about 224 KB a token at the
        9B shape) instead of the sequence's; the cost is one more forward of the layer. The same function as
        forward (tests/test_qwen3_5.py)."""
        if mixer.world() > 1:
            raise ValueError("deltanet_tile needs one device (cp 1): under context parallelism the state comes "
                             "from the ranks' span summaries")
        T = x.shape[1]
        starts = {0} if doc_lens is None else set(itertools.accumulate([0, *map(int, doc_lens)][:-1]))
        cuts = sorted(starts | set(range(0, T, self.tile))) + [T]
        out, state, tail = [], None, None
        for a, b in zip(cuts, cuts[1:]):
            if a in starts:
                state, tail = None, None
            y, state, tail = checkpoint(self._piece, x[:, a:b], mixer, state, tail, use_reentrant=False)
            out.append(y)
        return torch.cat(out, 1)

    def _piece(self, x, mixer, state, tail):
        """One piece of _tiled: x [B, t, H], the state before it (None: zeros), the K - 1 conv inputs before it
        (None: a document's start) -> (y [B, t, H], the state after it, its last K - 1 conv inputs)."""
        qkv = self.in_proj_qkv(x)
        if tail is None:
            tail = qkv.new_zeros(qkv.shape[0], self.conv1d.weight.shape[-1] - 1, qkv.shape[2])
        qkv = torch.cat([tail, qkv], 1)
        y = causal_conv(qkv, self.conv1d.weight, mixer.kernel).to(x.dtype)
        o, state = mixer.span_rule(*self._rule_inputs(x, y), state, final=True)
        return self._output(x, o), state, qkv[:, qkv.shape[1] - tail.shape[1]:]


class Block(nn.Module):
    """A decoder layer: a token mixer (Gated DeltaNet or gated attention), then model.py's SwiGLU MLP. It offers
    what model.py's recomputed block uses (index, recompute, keep_attention, offload, body), so that recompute,
    host offload and the kept attention output (full-attention layers only) are the core's, as for Qwen3."""

    def __init__(self, cfg: Qwen3_5Config, index: int, mixer: DeltaNetMixer, mlp: nn.Module | None = None):
        super().__init__()
        self.index, self.linear = index, cfg.layer_types[index] == "linear_attention"
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.linear:
            self.linear_attn, self.mixer = GatedDeltaNet(cfg), mixer
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp or MLP(cfg)  # model.py's SwiGLU: same names, same math (Qwen3.5-MoE: its experts)
        # memory levers (model.py, section 2), set by Qwen3_5.set_levers
        self.recompute = False       # keep only the block's input; recompute the rest in backward
        self.keep_attention = False  # ... and attention's output + lse (a DeltaNet block never attends)
        self.offload = None          # a model.HostOffload holding what is kept, or None

    forward = Qwen3Block.forward  # body, or under recompute model._RecomputedBlock around it

    def body(self, x, cos, sin, attend, mlp_value_is_read=True, doc_lens=None):
        """x [B, T, H] -> y [B, T, H]; attend as model.Block.body's (the gated attention's only)."""
        h = self.input_layernorm(x)
        if self.linear:
            x = x + self.linear_attn(h, self.mixer, doc_lens)
        else:
            x = x + self.self_attn(h, cos, sin, attend, doc_lens)
        return x + self.mlp(self.post_attention_layernorm(x), mlp_value_is_read)


class Qwen3_5(nn.Module):
    """The text decoder with its head (transformers' Qwen3_5ForCausalLM). attn_fn as model.Qwen3's; mixer: the
    DeltaNet layers' deltanet.DeltaNetMixer (default: one device); mlp(i): layer i's feed-forward module, as
    model.Qwen3's (default: the dense MLP)."""

    def __init__(self, cfg: Qwen3_5Config, attn_fn=causal_attention, mixer=None, mlp=None):
        super().__init__()
        self.cfg, self.attn_fn, self.mixer = cfg, attn_fn, mixer or DeltaNetMixer()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, self.mixer, mlp(i) if mlp else None)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, labels=None, loss_chunk=2048, doc_lens=None):
        """As model.Qwen3.forward: input_ids [B, T] (this rank's shard) -> hidden [B, T, H] after the final norm, or
        with labels [B, T] loss.NLL (loss_sum, n_valid). doc_lens: the (global) window's document lengths; then
        position_ids [B, T] must be given, counting from 0 in each document."""
        B, T = input_ids.shape
        if doc_lens is not None and position_ids is None:
            raise ValueError("doc_lens needs position_ids: the positions inside each document, from 0")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if position_ids.dim() != 2:
            raise ValueError("position_ids must be [B, T]: text positions only (no M-RoPE image grids)")
        rope = SimpleNamespace(head_dim=self.cfg.rotary_dim, rope_theta=self.cfg.rope_theta,
                               rope_scaling=self.cfg.rope_scaling)  # model.py's RoPE over the rotary part
        x = self.embed_tokens(input_ids)                                                   # [B, T, H]
        cos, sin = rope_cos_sin(position_ids, *rope_inv_freq(rope), x.dtype)  # [B, T, rotary_dim], as model.py's
        for block in self.layers:
            x = block(x, cos, sin, self.attn_fn, doc_lens)                                # [B, T, H]
        h = self.norm(x)
        if labels is None:
            return h
        return chunked_nll(h.reshape(B * T, -1), self.head_weight(), labels.reshape(B * T), chunk_size=loss_chunk)

    def logits(self, input_ids, position_ids=None, doc_lens=None):
        """Full logits [B, T, V], for tests and short evaluation only; not under FSDP2, which gathers the head for
        the forward alone (parallel.shard_model; retrieval.row_logits gathers it for a few rows)."""
        return self(input_ids, position_ids, doc_lens=doc_lens) @ self.head_weight().T

    def set_levers(self, recompute: bool = True, offload: bool = False, mlp_tile: int = 0,
                   offload_layers: int | None = None, keep_attention: bool = False,
                   keep_attention_layers: int | None = None):
        """model.Qwen3.set_levers' levers, the same arguments: recompute, offload and the tiled MLP in every block;
        the kept attention output in the full-attention blocks among the first keep_attention_layers."""
        Qwen3.set_levers(self, recompute, offload, mlp_tile, offload_layers, keep_attention, keep_attention_layers)
        for block in self.layers:
            block.keep_attention = block.keep_attention and not block.linear
        return self

    init_weights = Qwen3.init_weights  # each parameter in turn, by init_parameter

    def init_parameter(self, name: str, p: torch.Tensor, generator=None):
        """As transformers initialises: normal(0, initializer_range) matrices, zero-centred norms at 0, gated norms
        and dt_bias at 1, A = exp(A_log) uniform in [0.01, 16]."""
        if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
            p.fill_(1.0)
        elif name.endswith("norm.weight"):
            p.zero_()
        elif name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(0.01, 16, generator=generator).log())
        else:
            p.normal_(0.0, self.cfg.initializer_range, generator=generator)


class Qwen3_5Moe(moe.RouterLoss, Qwen3_5):
    """Qwen3.5-MoE (transformers' Qwen3_5MoeForCausalLM): Qwen3_5 with a moe.SharedExpertMoE as every layer's MLP.
    With labels, forward returns a moe.MoENLL whose aux_sum is the load-balancing loss under output_router_logits
    (moe.RouterLoss, as for Qwen3-MoE); cp_sum as moe.Qwen3MoE's."""

    def __init__(self, cfg: Qwen3_5MoeConfig, attn_fn=causal_attention, mixer=None, cp_sum=None):
        super().__init__(cfg, attn_fn, mixer, mlp=lambda i: moe.SharedExpertMoE(cfg))
        self.cp_sum = cp_sum


def model_class(cfg: Qwen3_5Config) -> type:
    return Qwen3_5Moe if isinstance(cfg, Qwen3_5MoeConfig) else Qwen3_5


# --- In train.py ---------------------------------------------------------------------------------

def check_flags(cfg, cp: int = 1, mcfg: Qwen3_5Config | None = None) -> str | None:
    """What train.py's flags (config.TrainConfig) ask of a Qwen3.5 (mcfg, or the one read from a local --model) at
    cp ranks a sequence that it does not do, in one line; or None (--lora_targets: config.check_model)."""
    try:
        resolve_kernel(getattr(cfg, "deltanet_kernel", "auto"))
        mcfg = mcfg or (read_config(cfg.model) if os.path.isdir(cfg.model) else None)  # a hub id's: once downloaded
        if mcfg and cfg.yarn_factor:
            mcfg.yarn_scaled(cfg.yarn_factor, cfg.yarn_original_max_position_embeddings)
    except ValueError as e:
        return str(e)
    history, chunk = (mcfg.linear_conv_kernel_dim - 1 if mcfg else 0), cfg.seq_len // (2 * cp)
    if cp > 1 and chunk < history:  # the conv's halo comes from the one chunk before (DeltaNetMixer.conv)
        return (f"--seq_len {cfg.seq_len} at cp {cp} cuts chunks of {chunk} tokens, fewer than the {history} tokens "
                f"the DeltaNet conv reads from the chunk before: pass --seq_len {2 * cp * history} or more")
    return None


def build(cfg, mcfg: Qwen3_5Config, attn_fn, cp_group) -> Qwen3_5:
    """train.py's model (cfg: its flags; on meta): the DeltaNet layers carry their state over the ranks of cp_group
    in the layout the data is sharded with: zigzag for one sequence, documents.cp_layout's for a window of
    documents (packing.py, with the same --doc_attention). Flags it does not support stop every rank here (a hub
    id's; a local folder's are refused before start-up by config.check_config)."""
    from million import documents
    from million.survival import SharedError
    cp = cp_group.size() if cp_group else 1
    why = check_flags(cfg, cp, mcfg)
    if why:
        raise SharedError(f"error: {why}")
    layout = functools.partial(documents.cp_layout, balanced=cfg.doc_attention == "balanced")
    kernel, slow = resolve_kernel(cfg.deltanet_kernel), None
    if kernel == "fla":  # checked against the torch rule at this model's head dims before it trains anything,
        # at a length that fills the GPU: fla's autotuner keys on the head dims, not the length, so the configs
        # it picks here are the ones the run keeps. Under cp also with dk more value columns (the span
        # summaries' form, DeltaNetMixer.rule), so that no config is tuned later, when the GPU is full
        gpu = torch.device("cuda", torch.cuda.current_device())
        dk, dv = mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
        with gpu, deltanet.local_memory_returned():  # build runs under train.py's meta device: whatever the
            # kernels allocate goes to the GPU; what the autotuner's spilling configs reserved is given back
            dtype = getattr(torch, cfg.dtype)
            try:
                why = None
                for width in (dv, dv + dk) if cp > 1 else (dv,):
                    why = why or deltanet.disagreement(deltanet.fla_rule, mcfg.linear_num_key_heads,
                                                       mcfg.linear_num_value_heads, dk, width, dtype, gpu, length=16384)
                why = why or deltanet.conv_disagreement(functools.partial(causal_conv, kernel="fla"),
                                                        mcfg.linear_conv_dim, mcfg.linear_conv_kernel_dim, dtype, gpu,
                                                        length=16384)
            except torch.AcceleratorError as e:  # a fault leaves the GPU unusable: no falling back in this process
                # (fla at dk 32, dv 64 on an H100: bench/NOTES.md, "Next on a GPU" item 6)
                raise SystemExit(f"error: fla's DeltaNet kernels faulted at dk {dk}, dv {dv} on this GPU "
                                 f"({str(e).splitlines()[0]}); pass --deltanet_kernel torch") from None
        if why and cfg.deltanet_kernel == "fla":
            raise SharedError(f"error: --deltanet_kernel fla: {why}; pass --deltanet_kernel torch")
        kernel, slow = ("torch", why) if why else (kernel, None)
    elif cfg.device == "cuda" and cfg.deltanet_kernel == "auto":  # (asked for by name: no warning)
        slow = f"fla: {deltanet.fla_unavailable()}; pip install fla-core triton>=3.7.1 for its GPU kernels"
    if slow:
        import warnings
        warnings.warn(f"the DeltaNet layers run on the torch rule, a Python loop over 64-token chunks ({slow})",
                      stacklevel=2)
    mixer = DeltaNetMixer(cp_group, layout=layout, kernel=kernel)
    if isinstance(mcfg, Qwen3_5MoeConfig):  # the load-balancing loss's counts are summed over the cp group
        import torch.distributed as dist
        model = Qwen3_5Moe(mcfg, attn_fn, mixer, cp_sum=lambda t: dist.all_reduce(t, group=cp_group))
    else:
        model = Qwen3_5(mcfg, attn_fn, mixer)
    for block in model.layers:
        if block.linear:
            block.linear_attn.tile = getattr(cfg, "deltanet_tile", 0)
    return model


# --- HF checkpoints ------------------------------------------------------------------------------

def _prefix(cfg: Qwen3_5Config) -> str:
    """Where the text decoder's weights sit in the checkpoint: a composite model nests it as language_model."""
    return "model.language_model." if cfg.raw.get("model_type") in COMPOSITE else "model."


def hf_name(name: str, cfg: Qwen3_5Config) -> str:
    return name if name.startswith("lm_head.") else _prefix(cfg) + name


def hf_names(name: str, cfg: Qwen3_5Config) -> list:
    """Our parameter name -> its tensors' names as transformers saves them: one, or for Qwen3.5-MoE's stacked
    expert weights one per expert (moe.hf_expert_names)."""
    experts = moe.hf_expert_names(name, getattr(cfg, "num_experts", 0))
    return [_prefix(cfg) + h.removeprefix("model.") for h in experts] if experts else [hf_name(name, cfg)]


def _read_safetensors(folder: str) -> dict:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    return {k: t for f in files for k, t in read_safetensors(os.path.join(folder, f)).items()}


def _is_text(hf: str, cfg: Qwen3_5Config) -> bool:
    return hf.startswith(_prefix(cfg)) or hf.startswith("lm_head.")


def _from_checkpoint(name: str, tensors: dict, cfg: Qwen3_5Config):
    """Our parameter `name` from a checkpoint's tensors -> (tensor or None when absent, the names it was read from).
    Expert weights come one per expert (as transformers saves them) or fused, [E, 2 I, H] gate then up and
    [E, H, I] down (as transformers holds them in memory)."""
    names = hf_names(name, cfg)
    if all(h in tensors for h in names):
        return (torch.stack([tensors[h] for h in names]) if len(names) > 1 else tensors[names[0]]), names
    if len(names) > 1:  # fused expert weights
        module, _, weight = hf_name(name, cfg).rpartition(".")
        fused = f"{module}.{'down_proj' if weight == 'down_proj' else 'gate_up_proj'}"
        if fused in tensors:
            t = tensors[fused]
            return t if weight == "down_proj" else t.chunk(2, 1)[weight == "up_proj"], [fused]
    return None, names


def load_state_dict_from_hf(folder: str, cfg: Qwen3_5Config, names: list, dtype) -> dict:
    """Our parameter names -> tensors in dtype from folder's *.safetensors; the text decoder's weights only."""
    tensors = _read_safetensors(folder)
    found = {n: _from_checkpoint(n, tensors, cfg) for n in names}
    missing = [h for t, hs in found.values() if t is None for h in hs]
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} weights of the text decoder, e.g. {missing[:3]}")
    used = {h for _, hs in found.values() for h in hs}
    extra = sorted(k for k in tensors if _is_text(k, cfg) and k not in used
                   and k != "lm_head.weight")  # a tied model may still carry a head
    if extra:
        raise ValueError(f"{folder}: checkpoint has text weights this model does not, e.g. {extra[:3]}")
    return {n: t.to(dtype) for n, (t, _) in found.items()}


def from_pretrained(folder: str, dtype=torch.bfloat16, attn_fn=causal_attention, mixer=None) -> Qwen3_5:
    cfg = read_config(folder)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, attn_fn, mixer)
    sd = load_state_dict_from_hf(folder, cfg, list(model.state_dict()), dtype)
    model.load_state_dict(sd, assign=True)
    return model


def save_hf(out_dir: str, cfg: Qwen3_5Config, state_dict: dict, max_shard_bytes: int = HF_SHARD_BYTES):
    """config.json + model.safetensors that transformers loads (AutoModelForCausalLM: Qwen3_5ForCausalLM, or
    Qwen3_5MoeForCausalLM with the experts one tensor each, as transformers saves them). For a
    composite checkpoint, the weights outside the text decoder (model.visual.*, mtp.*) are copied from cfg.source
    as they were read. Shards of at most max_shard_bytes, as hf.save_hf writes them."""
    tensors = {}
    for n, t in state_dict.items():
        hs, t = hf_names(n, cfg), t.detach().cpu()
        # an expert's slice is cloned: safetensors refuses tensors that share memory
        tensors.update({hs[0]: t.contiguous()} if len(hs) == 1 else {h: t[e].clone() for e, h in enumerate(hs)})
    if cfg.source:
        tensors.update({k: t for k, t in _read_safetensors(cfg.source).items() if not _is_text(k, cfg)})
    write_safetensors(out_dir, tensors, max_shard_bytes)
    dtype = str(next(iter(state_dict.values())).dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({**cfg.to_hf_dict(), "dtype": dtype}, fh, indent=2)


def save_pretrained(model: Qwen3_5, out_dir: str, state_dict=None):
    save_hf(out_dir, model.cfg, state_dict if state_dict is not None else model.state_dict())
