"""LoRA and QLoRA: train small adapters beside a frozen Qwen3, in bf16 or in 4-bit NF4.

A full fine-tune keeps 8 to 16 bytes a parameter (weights, gradients, two AdamW moments); Qwen3-8B then needs
more than one 80 GB GPU before any activation. LoRA (arXiv:2106.09685) freezes the model and trains, beside each
chosen projection W [out, in], two matrices A [r, in] and B [out, r]: y = x W^T + (x A^T) B^T * alpha / r. The
frozen base costs 2 bytes a parameter in bf16 (about 0.52 in NF4, arXiv:2305.14314), with no gradient and no
optimizer state; only the adapters have fp32 master weights and AdamW states.

It plugs into the model after it is built (on meta or CPU) and before FSDP2 shards it: `apply` replaces each
block's projections by a LoRALinear that keeps the base weight under its own name (HF checkpoints load as
before), and each dense MLP (and Qwen3.5-MoE's shared expert) by a LoRAMLP (the same SwiGLU, and the same
`forward(x, value_is_read)`), and freezes everything else. Nothing in the core changes: the ring, FSDP2,
recompute, offload and the kept attention see ordinary modules. The chunked loss skips the head's weight gradient (its weight needs none).

    torchrun --standalone --nproc_per_node 1 train.py --config demo --lora_rank 8      # CPU, a minute
    python -m pytest tests/test_lora.py -q      # against PEFT: loss, logits, every adapter gradient; cp 1/2/4

Adapters, named as PEFT names them (layers.N.self_attn.q_proj.lora_A.weight), are initialised as PEFT does (A
kaiming-uniform with a = sqrt(5), B zero, so that training starts from the base model). The export is a PEFT
adapter folder (`save`) or, merged, an HF checkpoint (W + alpha / r * B @ A). A mixture of experts: the MLP names
adapt Qwen3.5-MoE's shared expert (what PEFT's MLP targets adapt in transformers' model; Qwen3-MoE has none), and
the target `experts` adapts the routed experts' stacked weights as PEFT's target_parameters do (LoRAExperts: one A
and one B per weight, shared out among the experts); with NF4 the routed experts' weights are quantized too, and
dequantized a layer at a time. Qwen3.5 (qwen3_5.py):
its gated attention's projections, its Gated DeltaNet layers' (DELTANET) and the MLPs', by the names transformers
gives them.
"""
import importlib.util
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loss import addmm_fp32_
from million.moe import Experts, expert_adapters
from model import MLP, _silu_mul, _silu_mul_backward, fused

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's linear attention
TARGETS = ATTENTION + MLP_PROJECTIONS + DELTANET  # PEFT's all-linear, the head left out
# A mixture of experts' routed experts (their stacked gate_up and down weights): PEFT's target_parameters
# mlp.experts.gate_up_proj and mlp.experts.down_proj; not in all-linear, so asked for by name
EXPERTS = "experts"
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # QLoRA's: an absmax per 64 weights, the absmaxes quantized per 256
# Flags that say what a checkpoint's adapters are: a resumed run keeps them
FIXED_ON_RESUME = ("lora_rank", "lora_alpha", "lora_targets", "quantize")


def parse_targets(text: str) -> tuple:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); raises ValueError naming the choices."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TARGETS + (EXPERTS,)]
    if bad or not names:
        raise ValueError(f"--lora_targets {text!r}: a comma list of {','.join(TARGETS + (EXPERTS,))}")
    return names


def check_flags(rank: int, alpha: float, targets: str, quantize: str, merge: bool) -> str | None:
    """What is wrong with the LoRA flags (one line), or None."""
    if rank < 0 or alpha < 0:
        return "--lora_rank and --lora_alpha must be >= 0 (--lora_rank 0: no LoRA; --lora_alpha 0: 2 x rank)"
    if quantize not in ("", "nf4"):
        return f"--quantize {quantize}: use nf4, or leave it empty"
    if (quantize or merge) and not rank:
        return "--quantize and --merge_lora are for LoRA: give --lora_rank (e.g. 16)"
    if quantize and importlib.util.find_spec("torchao") is None:
        return "--quantize nf4 needs torchao: pip install torchao"
    try:
        parse_targets(targets)
    except ValueError as e:
        return str(e)
    return None


class _WaitsForNF4(nn.Module):
    """A module whose frozen weights become NF4 (quantize). Built on meta, they wait there as buffers until quantize
    fills them one at a time: to_empty and .to() leave a buffer on meta where it is, so the bf16 base is never whole
    on the GPU (Qwen3.5-35B-A3B's: 65 GB)."""

    def _apply(self, fn, recurse=True):
        waiting = [n for n, b in self._buffers.items() if b is not None and b.is_meta]
        held = {n: self._buffers[n] for n in waiting}
        self._buffers.update(dict.fromkeys(waiting))  # None: skipped, and the buffers keep their places
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(held)


class LoRALinear(_WaitsForNF4):
    """A frozen projection y = x W^T and, with rank > 0, PEFT's LoRA beside it: + B(A(x)) * alpha / rank.

    W stays `weight` (a frozen Parameter, sharded by FSDP2 like the rest; with nf4, a buffer that `quantize`
    turns into an NF4Tensor, held whole on every rank). A and B are `lora_A.weight` [rank, in] and
    `lora_B.weight` [out, rank], in the dtype W had before it was frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, nf4: bool = False, base_dtype=None):
        super().__init__()
        w = base.weight
        self.in_features, self.out_features, self.rank = base.in_features, base.out_features, rank
        self.scaling = alpha / rank if rank else 0.0
        if rank:
            self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
            self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=w.device, dtype=w.dtype)
            init_adapter(self.lora_A.weight, self.lora_B.weight)
        w = w.detach().to(base_dtype or w.dtype)
        if nf4:  # a persistent buffer until quantized: the state dict still loads it by name
            self.register_buffer("weight", w)
        else:
            self.weight = nn.Parameter(w, requires_grad=False)

    def adapters(self) -> tuple:
        return (self.lora_A.weight, self.lora_B.weight) if self.rank else ()

    def forward(self, x):
        # An NF4Tensor weight is dequantized to x's dtype inside F.linear (torchao's). The adapter's B(A(x) *
        # alpha/r) is added by the GEMM itself (addmm_, beta 1): the scale falls on the [.., rank] intermediate
        # and y is read and written once more, not three times over (bench/NOTES.md, LoRA)
        y, _ = _rows(x.flatten(0, -2), self.weight, self.adapters(), self.scaling)
        return y.view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def init_adapter(a, b, generator=None):
    """PEFT's initialisation: A kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero."""
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    b.zero_()


def _rows(x, w, ab, s, out=None):
    """A LoRALinear on rows x [t, in]: w the frozen weight, ab its (A, B) or () -> (y, x A^T or None); y written
    into out [t, out] if given (w then dense). The adapter is added in place (addmm_): an out-of-place addmm
    first copies y into a new tensor, two more passes over [t, out]."""
    y = F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)
    if not ab:
        return y, None
    a = F.linear(x, ab[0])
    return y.addmm_(a * s, ab[1].t()), a


def _rows_backward(dy, x, w, ab, s, acc, dx, a=None, add=False):
    """The backward of _rows: dx (= or, add: +=) dy W + s (dy B) A, and (ab) acc = (dA, dB) fp32 +=
    (s dy B)^T x, s dy^T (x A^T). a: x A^T if the forward kept it. The frozen W gets no gradient."""
    if add:
        dx.addmm_(dy, w)
    else:
        torch.mm(dy, w, out=dx)
    if ab:
        A, B = ab
        a = F.linear(x, A) if a is None else a
        addmm_fp32_(acc[1], dy.t(), a * s)
        e = (dy @ B) * s                                                   # [t, r]
        addmm_fp32_(acc[0], e.t(), x)
        dx.addmm_(e, A)


class _TiledLoRAMLP(torch.autograd.Function):
    """LoRAMLP over tiles of rows, its backward written out as model._TiledMLP's: per tile the gate and up
    projections recomputed (the down projection's output is never needed), the SwiGLU's gradient in one fused
    kernel, dX through the frozen weights, and the adapters' gradients summed in fp32 and rounded once. An NF4
    weight is dequantized once per pass, not at each tile. parts: per projection (gate, up, down), its weight,
    then its A and B if it has an adapter.

    keep (the lever LoRAMLP.keep): the forward writes gate's and up's outputs [T, I] whole and keeps them for the
    backward, which then skips their GEMMs: 4 x T x hidden x I FLOPs less, for 2 x T x I values held from the
    forward to the backward. keep "node": an ordinary autograd forward, this node's backward follows; "module": a
    recomputed block's forward (under no_grad, model._RecomputedBlock), so they wait on the module (mlp.kept)
    until the backward's recompute (value_is_read False) takes them."""

    @staticmethod
    def forward(ctx, x, tile, value_is_read, keep, mlp, *parts):
        ctx.tile, ctx.mlp, ctx.kept = tile, mlp, None
        ctx.save_for_backward(x, *parts)
        rows = x.reshape(-1, x.shape[-1])
        if not value_is_read:  # a recomputed block's backward: only the graph is used (as in _TiledMLP), and
            kept, mlp.kept = mlp.kept, None  # gate's and up's outputs serve its backward if the forward kept them
            if kept is not None and kept[0].shape[0] == rows.shape[0] and kept[0].device == rows.device:
                ctx.kept = kept
            return x.new_empty(x.shape)
        mlp.kept = None
        (wg, g_ab, sg), (wu, u_ab, su), (wd, d_ab, sd) = _projections(mlp, parts, x.dtype)
        y, n = torch.empty_like(rows), -(-rows.shape[0] // tile)
        g, u = (rows.new_empty(rows.shape[0], wg.shape[0]) for _ in "gu") if keep else (None, None)
        gs, us = (g.split(tile), u.split(tile)) if keep else ([None] * n, [None] * n)
        for xt, yt, gt, ut in zip(rows.split(tile), y.split(tile), gs, us):
            gt, ut = _rows(xt, wg, g_ab, sg, gt)[0], _rows(xt, wu, u_ab, su, ut)[0]
            _rows(fused(_silu_mul, gt)(gt, ut), wd, d_ab, sd, yt)
        if keep == "node":
            ctx.kept = (g, u)
        elif keep == "module":
            mlp.kept = (g, u)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, *parts = ctx.saved_tensors
        rows, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, x.shape[-1])
        (wg, g_ab, sg), (wu, u_ab, su), (wd, d_ab, sd) = _projections(ctx.mlp, parts, x.dtype)
        acc = [[torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in ab]
               for ab in (g_ab, u_ab, d_ab)]
        dx, n = torch.empty_like(rows), -(-rows.shape[0] // ctx.tile)
        kept, ctx.kept = ctx.kept, None
        gs, us = (kept[0].split(ctx.tile), kept[1].split(ctx.tile)) if kept else ([None] * n, [None] * n)
        for xt, dyt, dxt, gk, uk in zip(rows.split(ctx.tile), dy.split(ctx.tile), dx.split(ctx.tile), gs, us):
            if gk is None:
                (g, ag), (u, au) = _rows(xt, wg, g_ab, sg), _rows(xt, wu, u_ab, su)   # [t, I], [t, r]
            else:  # kept by the forward; x A^T is made again where needed (a rank-r GEMM)
                (g, ag), (u, au) = (gk, None), (uk, None)
            h = fused(_silu_mul, g)(g, u)
            dh = torch.empty_like(h)
            _rows_backward(dyt, h, wd, d_ab, sd, acc[2], dh)                      # dh = dy W_down (+ adapter)
            dg, du = fused(_silu_mul_backward, g)(dh, g, u)
            _rows_backward(dg, xt, wg, g_ab, sg, acc[0], dxt, ag)                 # dx = dg W_gate + du W_up
            _rows_backward(du, xt, wu, u_ab, su, acc[1], dxt, au, add=True)
        grads = []  # per projection: none for the frozen weight, then its adapters', rounded once
        for ab, ga in zip((g_ab, u_ab, d_ab), acc):
            grads += [None, *(a.to(t.dtype) for t, a in zip(ab, ga))]
        return dx.view(x.shape), None, None, None, None, *grads


def _projections(mlp, parts, dtype) -> list:
    """_TiledLoRAMLP's parts regrouped per projection (gate, up, down): [(dense weight, (A, B) or (), scale)]."""
    groups = []
    for name in MLP_PROJECTIONS:
        m = getattr(mlp, name)
        k = 3 if m.rank else 1
        groups.append((dense(parts[0], dtype), tuple(parts[1:k]), m.scaling))
        parts = parts[k:]
    return groups


def is_nf4(w) -> bool:
    """Is w torchao's NF4Tensor?"""
    return hasattr(w, "get_original_weight")


def dense(w, dtype):
    """A frozen weight as a plain tensor of dtype: an NF4Tensor dequantized (torchao), any other as it is."""
    return w.get_original_weight().to(dtype) if is_nf4(w) else w.to(dtype)


class LoRAMLP(nn.Module):
    """model.MLP with LoRALinear projections: down(silu(gate(x)) * up(x)), tiled along the sequence as MLP is
    (`tile`, set by Qwen3.set_levers) but through _TiledLoRAMLP, whose backward gives the adapters' gradients."""

    def __init__(self, mlp: MLP, rank: int, alpha: float, targets, nf4=False, base_dtype=None):
        super().__init__()
        for name in MLP_PROJECTIONS:
            setattr(self, name, LoRALinear(getattr(mlp, name), rank if name in targets else 0, alpha, nf4,
                                           base_dtype))
        self.tile = mlp.tile
        self.keep = False  # a lever (keep_mlp): keep gate's and up's outputs from the forward for the backward
        self.kept = None   # ... those of the last recomputed block's forward, until its backward takes them

    def swiglu(self, x):
        return self.down_proj(fused(_silu_mul, x)(self.gate_proj(x), self.up_proj(x)))

    def forward(self, x, value_is_read=True):
        rows = x.shape[:-1].numel()
        if self.keep or (self.tile and x.shape[-2] > self.tile):
            parts = []  # per projection: its weight, then its adapters
            for m in (self.gate_proj, self.up_proj, self.down_proj):
                parts += [m.weight, *m.adapters()]
            tile = self.tile if self.tile and x.shape[-2] > self.tile else rows
            # kept in training only (an evaluation, in eval mode, has no backward to serve)
            keep = ("node" if torch.is_grad_enabled() else "module") if self.keep and self.training else ""
            return _TiledLoRAMLP.apply(x, tile, value_is_read, keep, self, *parts)
        return self.swiglu(x)


class LoRAExperts(_WaitsForNF4, Experts):
    """moe.Experts (the routed experts' stacked weights, frozen) with PEFT's adapters on gate_up and down, as its
    target_parameters put them: for each, one A [r E, in] and one B [out, r E], expert e's delta B[:, e::E] @
    A[e r:(e+1) r] (moe.expert_adapters) and gate_up's rows gate then up. moe_rows adds them through thin GEMMs
    (x A_e^T, then B_e), never a weight's delta. Named as PEFT names them, so that its adapter folder loads as it
    is: PEFT wraps one parameter at a time in name order, so down's adapters sit on the module (lora_A, lora_B)
    and gate_up's on the wrapper inside it (base_layer.lora_A, base_layer.lora_B).

    Rank 0: no adapters (the experts frozen, as they are without the target `experts`). nf4: the three weights are
    buffers that `quantize` turns into NF4Tensors (each stored as [E x out, in]); `weights` dequantizes them once
    per pass of the block (its forward, its recompute), so the grouped GEMMs take one layer's experts whole in
    bf16 while that block runs, and NF4 the rest of the time (QLoRA)."""
    ADAPTERS = ("base_layer.lora_A.weight", "base_layer.lora_B.weight", "lora_A.weight", "lora_B.weight")
    WEIGHTS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, base: Experts, rank: int, alpha: float, nf4: bool = False, base_dtype=None):
        nn.Module.__init__(self)
        for name in self.WEIGHTS:
            w = getattr(base, name)
            if nf4:  # buffers until quantized, in the base's dtype: the state dict still loads them by name
                self.register_buffer(name, w.detach().to(base_dtype or w.dtype))
            else:
                setattr(self, name, w)
        (E, I, H), w = self.gate_proj.shape, self.gate_proj
        self.num_experts, self.rank, self.scaling = E, rank, alpha / rank if rank else 0.0
        if rank:
            self.base_layer = nn.Module()
            for m, i, o in ((self.base_layer, H, 2 * I), (self, I, H)):
                m.lora_A = nn.Linear(i, rank * E, bias=False, device=w.device, dtype=w.dtype)
                m.lora_B = nn.Linear(rank * E, o, bias=False, device=w.device, dtype=w.dtype)
                init_adapter(m.lora_A.weight, m.lora_B.weight)

    def base(self, name: str) -> torch.Tensor:
        """A stacked weight [E, out, in] as the GEMMs take it: an NF4 one dequantized."""
        w = getattr(self, name)
        return w.get_original_weight().view(self.num_experts, -1, w.shape[-1]) if is_nf4(w) else w

    def weights(self) -> tuple:
        return (*map(self.base, self.WEIGHTS), *(self.get_parameter(n) for n in self.ADAPTERS if self.rank))

    @torch.no_grad()
    def merged(self, sd: dict, name: str) -> dict:
        """{its three weights' full names: W + alpha / r * B_e @ A_e in fp32} from the full state dict sd (on the
        host; the NF4 weights, which it leaves out, dequantized)."""
        w = {p: (sd[f"{name}.{p}"] if f"{name}.{p}" in sd else self.base(p).cpu()).float() for p in self.WEIGHTS}
        if not self.rank:
            return {f"{name}.{p}": t for p, t in w.items()}
        a_gu, b_gu, a_d, b_d = expert_adapters([sd[f"{name}.{n}"].float() for n in self.ADAPTERS], len(w["gate_proj"]))
        dg, du = (self.scaling * b_gu @ a_gu).chunk(2, 1)                           # [E, I, H] each
        w["gate_proj"], w["up_proj"] = w["gate_proj"] + dg, w["up_proj"] + du
        w["down_proj"] = w["down_proj"] + self.scaling * b_d @ a_d
        return {f"{name}.{p}": t for p, t in w.items()}


def keep_mlp(model, layers: int):
    """The lever keep_mlp: the last `layers` blocks' LoRAMLPs keep gate's and up's outputs for the backward (on the
    GPU, never offloaded: 2 x T x intermediate values each); the last ones, whose backward comes first. -> model."""
    for block in model.layers:
        if isinstance(block.mlp, LoRAMLP):
            block.mlp.keep = block.index >= len(model.layers) - layers
    return model


class InputEmbedding(nn.Module):
    """The frozen embedding, its output made part of the graph: a recomputed block takes its input as its only
    tensor input (model._RecomputedBlock), so with nothing before the first block that trains, the blocks' graph
    would otherwise never start. transformers' enable_input_require_grads makes the output a leaf that requires
    grad; a leaf stays alive until the backward ends (the graph holds it to accumulate its gradient) and gets a
    gradient no one reads, each [T, hidden]. _GraphStart passes the output through a node instead, so it lives
    only as long as the first block keeps it (with offload: until its copy to the host is done)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight
        self.anchor = torch.empty(0, requires_grad=True)  # not a parameter: nothing to train, save or shard

    def forward(self, ids):
        x = F.embedding(ids, self.weight)
        return _GraphStart.apply(x, self.anchor) if torch.is_grad_enabled() and not x.requires_grad else x


class _GraphStart(torch.autograd.Function):
    """x as it is, as the output of a node that requires grad (through an empty anchor) and whose backward drops
    the gradient."""

    @staticmethod
    def forward(ctx, x, anchor):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return None, None


def moe_targets_error(mcfg, targets) -> str | None:
    """A mixture of experts' (Qwen3-MoE, Qwen3.5-MoE) routed experts take adapters when asked (EXPERTS); a dense
    model has none to adapt. The MLP names adapt Qwen3.5-MoE's shared expert, as PEFT's do on
    transformers' model; Qwen3-MoE has none, so there they are refused. One line saying what to pass, or None."""
    if not getattr(mcfg, "num_experts", 0):
        return ("--lora_targets experts: this model has no routed experts (a dense model); drop it"
                if EXPERTS in targets else None)
    hybrid = bool(getattr(mcfg, "layer_types", None))  # Qwen3.5-MoE: DeltaNet layers beside attention
    allowed = ATTENTION + (DELTANET + MLP_PROJECTIONS if hybrid else ())
    bad = [t for t in targets if t not in allowed + (EXPERTS,)]
    if bad:
        return (f"--lora_targets {','.join(bad)}: not projections of Qwen3-MoE (its MLP is its routed experts); "
                f"pass --lora_targets {','.join(allowed)} (attention), with ,{EXPERTS} to adapt the experts too")
    return None


def apply(model, rank: int, alpha: float = 0.0, targets=TARGETS, base_dtype=None, quantize: str = ""):
    """Freeze every parameter of model (a Qwen3 or Qwen3.5, on meta or CPU, before FSDP2) in base_dtype (default: as
    it is) and give the projections named in targets (a tuple, or a comma list) adapters of `rank` in the model's
    dtype; alpha 0 means 2 x rank (PEFT's default is 8). quantize "nf4": the blocks' projections and the routed
    experts' weights become NF4 once loaded (`quantize`). -> model."""
    targets = parse_targets(targets) if isinstance(targets, str) else tuple(targets)
    why = moe_targets_error(model.cfg, targets)
    if why:
        raise ValueError(why)
    alpha, nf4 = alpha or 2.0 * rank, quantize == "nf4"
    for p in model.parameters():
        p.requires_grad_(False)
    model.embed_tokens = InputEmbedding(model.embed_tokens)
    for block in model.layers:  # attention, or (Qwen3.5) a Gated DeltaNet layer in its place
        mixer, names = (block.self_attn, ATTENTION) if hasattr(block, "self_attn") else (block.linear_attn, DELTANET)
        for name in names:
            base = getattr(mixer, name)
            setattr(mixer, name, LoRALinear(base, rank if name in targets else 0, alpha, nf4, base_dtype))
        if isinstance(block.mlp, MLP):
            block.mlp = LoRAMLP(block.mlp, rank, alpha, targets, nf4, base_dtype)
        elif isinstance(getattr(block.mlp, "shared_expert", None), MLP):  # Qwen3.5-MoE's (PEFT's MLP targets)
            block.mlp.shared_expert = LoRAMLP(block.mlp.shared_expert, rank, alpha, targets, nf4, base_dtype)
        experts = getattr(block.mlp, "experts", None)
        if isinstance(experts, Experts) and (nf4 or rank and EXPERTS in targets):
            block.mlp.experts = LoRAExperts(experts, rank if EXPERTS in targets else 0, alpha, nf4, base_dtype)
    if rank and not any(m.rank for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))):
        raise ValueError(f"--lora_targets {','.join(targets)}: none is a projection of this model's blocks")
    if base_dtype is not None:
        for name, p in model.named_parameters():
            if not is_adapter(name):
                p.data = p.data.to(base_dtype)
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(shapes: dict, seed: int, dtype=torch.float32) -> dict:
    """The adapters of a model with these parameter shapes ({name: shape}), drawn as PEFT draws them from `seed`,
    the same on any world size: what train.py loads beside the base weights."""
    gen, sd = torch.Generator().manual_seed(seed), {}
    for name in sorted(n for n in shapes if n.endswith(".lora_A.weight")):
        b = name.replace(".lora_A.", ".lora_B.")
        sd[name], sd[b] = torch.empty(shapes[name], dtype=dtype), torch.empty(shapes[b], dtype=dtype)
        init_adapter(sd[name], sd[b], gen)
    return sd


def torchao_to_nf4():
    """torchao's to_nf4(tensor, block_size, scaler_block_size), imported on first use (where torchao 0.18 has it,
    or where earlier versions did)."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        try:
            from torchao.dtypes import to_nf4
        except ImportError as e:
            raise ImportError(f"--quantize nf4 needs torchao ({e}): pip install torchao") from None
    return to_nf4


def nf4(w: torch.Tensor):
    """w [out, in] -> torchao's NF4Tensor: 4-bit NormalFloat codes, an absmax per NF4_BLOCK weights, the absmaxes
    quantized to int8 per NF4_SCALER_BLOCK of them (for a small model, per the largest power of two, at least 16,
    that divides their count; every Qwen3 projection takes 256)."""
    blocks = w.numel() // NF4_BLOCK
    scaler_block = math.gcd(blocks, NF4_SCALER_BLOCK)
    if w.numel() % NF4_BLOCK or scaler_block < 16:
        raise ValueError(f"NF4 needs weights of a multiple of {NF4_BLOCK * 16} elements; {tuple(w.shape)} is not")
    return torchao_to_nf4()(w.contiguous(), NF4_BLOCK, scaler_block)


@torch.no_grad()
def quantize(model, sd: dict | None = None, device=None):
    """Each block projection's frozen weight, and each routed expert's stacked weight ([E, out, in] as [E x out,
    in]), becomes an NF4Tensor (a buffer that checkpoints leave out: the base is reloaded from the model on resume).
    A weight still on meta (train.py: _WaitsForNF4) comes out of sd, rank 0's full state dict (None on the others),
    to `device`, over a broadcast to every rank, one at a time; its name leaves sd, which then loads the rest.
    -> model."""
    for name, m in model.named_modules():
        names = [n for n in ("weight", *LoRAExperts.WEIGHTS) if n in m._buffers and not is_nf4(m._buffers[n])]
        for n in names if isinstance(m, (LoRALinear, LoRAExperts)) else ():
            w = m._buffers[n]
            if w.is_meta:  # rank 0 has sd; the others receive its values below
                if sd is None and not (dist.is_initialized() and dist.get_rank() > 0):
                    raise ValueError(f"{name}.{n} waits on meta for its weights: pass the full state dict")
                w = sd.pop(f"{name}.{n}").to(device, w.dtype) if sd is not None else torch.empty_like(w, device=device)
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast(w, src=0)
            try:
                q = nf4(w.reshape(-1, w.shape[-1]))
            except ValueError as e:  # every real Qwen3's and Qwen3.5's projections split into NF4's blocks
                raise ValueError(f"--quantize nf4: {name}: {e}; this model takes LoRA without --quantize") from None
            m.register_buffer(n, q, persistent=False)
    return model


def base_weight(m: LoRALinear, sd: dict, name: str) -> torch.Tensor:
    """A projection's frozen weight, from the full state dict (on the host) or (NF4, which checkpoints leave out)
    dequantized."""
    return sd[name] if name in sd else m.weight.get_original_weight().cpu()


def merged_state_dict(model, sd: dict, dtype) -> dict:
    """The full state dict (sd: every parameter, gathered) with each adapter merged into its projection,
    W + alpha / r * B @ A in fp32, every tensor in dtype: a plain Qwen3 checkpoint."""
    out = {n: t for n, t in sd.items() if not is_adapter(n)}
    for name, m in model.named_modules():
        if isinstance(m, LoRAExperts):
            out.update(m.merged(sd, name))
        elif isinstance(m, LoRALinear):
            w = base_weight(m, sd, f"{name}.weight").float()
            if m.rank:
                a, b = sd[f"{name}.lora_A.weight"].float(), sd[f"{name}.lora_B.weight"].float()
                w = w + m.scaling * (b @ a)
            out[f"{name}.weight"] = w
    return {n: t.to(dtype) for n, t in out.items()}


def adapter_config(model, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for these adapters (the routed experts': target_parameters)."""
    m = next(m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts)) and m.rank)
    targets = sorted({name.rpartition(".")[2] for name, x in model.named_modules()
                      if isinstance(x, LoRALinear) and x.rank})
    experts = any(isinstance(x, LoRAExperts) and x.rank for x in model.modules())
    return dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model, r=m.rank,
                lora_alpha=m.scaling * m.rank, target_modules=targets,
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None,
                lora_dropout=0.0, bias="none",
                fan_in_fan_out=False, init_lora_weights=True, use_rslora=False, use_dora=False,
                modules_to_save=None, inference_mode=True)


def save(folder: str, model, sd: dict, base_model: str, merge: bool = False, dtype=torch.float32):
    """The export: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors under PEFT's names,
    base_model.model.model.layers.N....lora_A.weight) that peft.PeftModel.from_pretrained loads over the base;
    or, merged, an HF checkpoint that transformers loads alone. sd: the full state dict (the adapters alone
    will do unless merged). Every HF file of LoRA is written here."""
    from safetensors.torch import save_file

    from million.hf import hf_name, save_hf
    if merge:
        return save_hf(folder, model.cfg, merged_state_dict(model, sd, dtype))
    os.makedirs(folder, exist_ok=True)
    tensors = {"base_model.model." + hf_name(n, model.cfg): t.detach().to(dtype).contiguous().cpu()
               for n, t in sd.items() if is_adapter(n)}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(os.path.join(folder, "adapter_model.safetensors"), 0o666 & ~umask)  # safetensors writes 0600
    with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
        json.dump(adapter_config(model, base_model), fh, indent=2)


def describe(model) -> str:
    """One line for the log: the adapters, their size, the base."""
    lin = [m for m in model.modules() if isinstance(m, LoRALinear)]
    experts = [m for m in model.modules() if isinstance(m, LoRAExperts) and m.rank]
    adapted = [m for m in lin if m.rank] + experts
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    nf4_base = [w for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))
                for w in m.buffers(recurse=False) if is_nf4(w)]
    total = sum(p.numel() for p in model.parameters()) + sum(w.numel() for w in nf4_base)
    base = "NF4" if nf4_base else str(next(p.dtype for p in model.parameters() if not p.requires_grad))[6:]
    where = " and ".join(([f"{len(adapted) - len(experts)} projections"] if len(adapted) > len(experts) else [])
                         + ([f"the routed experts of {len(experts)} layers"] if experts else []))
    return (f"LoRA: rank {adapted[0].rank}, alpha {adapted[0].scaling * adapted[0].rank:g} on {where}: "
            f"{trained / 1e6:.2f} M trained parameters ({trained / total:.2%}); the base frozen in {base}")
