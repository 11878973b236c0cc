"""Qwen3 for million-token training, in two parts:

1. The plain Qwen3: config, RoPE with YaRN, RMSNorm, attention, SwiGLU MLP, the decoder. It reads like
   transformers' modeling_qwen3.py (same names) and can be diffed against it.
2. Memory levers: what lets one sequence of a million tokens fit. The recomputed block, whose kept tensors can
   live in pinned host memory (HostOffload), told once at the top of that section; custom autograd Functions
   that keep less than autograd would (RMSNorm, RoPE, the tiled MLP).

The model never imports torch.distributed: attention is a function `attn_fn(q, k, v) -> out` it is given
(causal SDPA on one device, the ring of parallel.py under context parallelism); for a window of several documents,
`attn_fn(q, k, v, doc_lens)`. A block takes its MLP: `mlp(index) -> module` builds each block's (default: the
SwiGLU MLP), so that another feed-forward block comes in as an argument, not as a change here.

    python -c "from model import *; m = Qwen3(Qwen3Config.tiny()); print(m(torch.zeros(1, 8, dtype=torch.long)).shape)"
    python -m pytest tests/test_model.py -q
"""
import dataclasses
import functools
import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from loss import addmm_fp32_, chunked_nll  # the tiled MLP's weight gradients share the loss's fp32 GEMM

# =============================================================================================
# 1. The plain Qwen3
# =============================================================================================


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
    raw: dict = field(default_factory=dict, repr=False)  # the config.json as read, written back on save

    @classmethod
    def tiny(cls, **kw) -> "Qwen3Config":
        """A small random Qwen3 for the demo and tests (vocab 257 = bytes + end-of-text); kw: fields changed."""
        return dataclasses.replace(cls(vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                                       max_position_embeddings=4096), **kw)

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
    """cos, sin [B, T, head_dim] in dtype for the positions present: never a table of max_positions x head_dim.
    Angles are formed in float64: at position 1,048,576 an fp32 product pos * inv_freq is off by up to 0.06 rad."""
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


def causal_attention(q, k, v):
    """Default attn_fn (one device, one sequence): q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D]; GQA
    without repeating K/V. Windows of documents: documents.masked_attention."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


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
        ws = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        if self.tile and x.shape[-2] > self.tile:
            return _TiledMLP.apply(x, self.tile, value_is_read, *ws)
        return _swiglu(x, *ws)


class Block(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int, mlp: nn.Module):
        """mlp: the feed-forward module, mlp(x, value_is_read) -> y [B, T, H], with a `tile` attribute
        (set_levers)."""
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        # memory levers (section 2), set by Qwen3.set_levers
        self.recompute = False       # keep only the block's input; recompute the rest in backward
        self.keep_attention = False  # ... and attention's output + lse, so the recompute skips attention
        self.offload = None          # a HostOffload (shared by the blocks) holding what is kept, or None

    def body(self, x, cos, sin, attend, mlp_value_is_read=True, doc_lens=None):
        """x [B, T, H] -> y [B, T, H]."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, doc_lens)
        return h + self.mlp(self.post_attention_layernorm(h), mlp_value_is_read)

    def forward(self, x, cos, sin, attn_fn, doc_lens=None):
        if self.recompute and torch.is_grad_enabled():
            return _RecomputedBlock.apply(x, cos, sin, self, attn_fn, doc_lens)
        return self.body(x, cos, sin, attn_fn, doc_lens=doc_lens)


class Qwen3(nn.Module):
    def __init__(self, cfg: Qwen3Config, attn_fn=causal_attention, mlp=None):
        """mlp(index) -> the feed-forward module of block `index` (Block's mlp); None: the SwiGLU MLP in each."""
        super().__init__()
        self.cfg, self.attn_fn = cfg, attn_fn
        if mlp is None and type(cfg) is not Qwen3Config:  # a subclass's fields would be ignored: silently wrong
            raise ValueError(f"a {type(cfg).__name__} is built by {getattr(cfg, 'model_class', 'its own class')}, "
                             "not by Qwen3 with dense MLPs")
        mlp = mlp or (lambda index: MLP(cfg))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, mlp(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, labels=None, loss_chunk=2048, doc_lens=None):
        """input_ids [B, T] -> hidden [B, T, H] after the final norm; with labels [B, T], the chunked
        (loss_sum fp32, n_valid) instead (loss.NLL), computed here so that FSDP2 gathers the head weight once per
        step. doc_lens: the window's documents (their lengths in order over the whole window, the same in every
        row; under context parallelism the global window, not this rank's shard): attention stays inside each.
        Then position_ids [B, T] must be given, each document's counting from 0 (zigzag-sharded like the tokens)."""
        B, T = input_ids.shape
        if doc_lens is not None and position_ids is None:
            raise ValueError("doc_lens needs position_ids: the positions inside each document, from 0")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids)                                                  # [B, T, H]
        # in the activations' dtype, which RoPE runs in anyway (apply_rope): one pair for every block, where
        # FSDP2's cast of each block's inputs would make a copy per block, each kept for its backward
        cos, sin = rope_cos_sin(position_ids, *rope_inv_freq(self.cfg), x.dtype)          # [B, T, D]
        for block in self.layers:
            x = block(x, cos, sin, self.attn_fn, doc_lens)                               # [B, T, H]
        h = self.norm(x)
        if labels is None:
            return h
        with torch.profiler.record_function("chunked_nll"):  # named in profiles (train.py --profile_step)
            return chunked_nll(h.reshape(B * T, -1), self.head_weight(), labels.reshape(B * T), chunk_size=loss_chunk)

    def logits(self, input_ids, position_ids=None, doc_lens=None):
        """Full logits [B, T, V], for tests and short evaluation only; not under FSDP2, which gathers the head for
        the forward alone (parallel.shard_model; retrieval.row_logits gathers it for a few rows)."""
        return self(input_ids, position_ids, doc_lens=doc_lens) @ self.head_weight().T

    @torch.no_grad()
    def init_weights(self, generator=None):
        for name, p in self.named_parameters():
            self.init_parameter(name, p, generator)

    def init_parameter(self, name: str, p: torch.Tensor, generator=None):
        """As transformers initialises: norms at 1, every matrix normal(0, initializer_range)."""
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, self.cfg.initializer_range, generator=generator)

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
# Then autograd runs the rebuilt graph backward from the block's output gradient. The block's parameters are not
# inputs of _RecomputedBlock: this inner backward accumulates their gradients (as reentrant checkpointing does),
# and FSDP2's post-backward hook reduce-scatters them.
#
# GPU memory: with every block offloaded, two blocks' kept tensors are on the GPU at a time (the one running
# backward and the one brought back ahead of it). A block without an offload keeps its own there from its
# forward to its backward.


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
            y = block.body(x, cos, sin, attend, doc_lens=doc_lens)
        kept = {"x": x}
        if isinstance(attend, _KeptAttention):
            kept.update(out=attend.out, lse=attend.lse)
        ctx.names = list(kept)
        if block.offload is not None:
            for name, t in kept.items():
                block.offload.save((block.index, name), t)
            kept = {}
        ctx.save_for_backward(cos, sin, *kept.values())
        return y

    @staticmethod
    def backward(ctx, dy):
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
            y = block.body(x, cos, sin, attend, mlp_value_is_read=False, doc_lens=ctx.doc_lens)
            # y is the residual add's output, whose backward reads no value: its memory goes before the block's
            # backward runs, not after (H values a token: 2 GiB at 262,144 tokens of hidden 4,096)
            y.untyped_storage().resize_(0)
            torch.autograd.backward(y, dy)
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
        # Wait for the copies two blocks back, else the CPU runs ahead and freed tensors pile up
        earlier = self.copied.pop(key[0] - 2, None)
        if earlier is not None:
            earlier.synchronize()

    def _fetch(self, key, device):
        buf = self.host[key]
        stream = self._side_stream(device)
        if stream is None:
            return buf.clone(), None
        # Allocated on the compute stream: reused in its order, however far the CPU runs ahead
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
    """RMSNorm keeping only x and rstd for backward: autograd of the same formula keeps fp32 copies of x."""

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
