"""What one training step costs per rank, and the fastest set of memory levers that fits a node.

    python -m million.plan --model bench/configs/qwen3-8b --seq_len 1048576 --nproc 8 --gpu_mem_gib 74.5 --host_mem_gib 1907
    python bench/fit_plan.py --fit     # re-fit FITTED to the runs in bench/results/ and print the errors
    python bench/fit_plan.py --check   # the errors out of sample

A plain arithmetic model, one function per quantity, with a few constants fitted to measured runs:
- pinned host memory: exact (the tensors the offloaded blocks keep: their input, and attention's output + lse,
  each in whole pages as model.HostOffload pins it);
- peak GPU memory: FSDP2 state (weights and AdamW's two moments, each 1/world of the model in param_dtype) +
  the larger of the gradients and what stays on the GPU for blocks that are not offloaded + the chunked loss's
  buffers + a working set per token (and the ring's buffers when cp > 1);
- step time: attention FLOPs at a measured rate per kernel backend + GEMM FLOPs at a measured rate + a
  per-token-per-layer term for everything else (norms, RoPE, SwiGLU, copies). The ring's overhead is left out:
  it measured 97-103% of the ideal split (bench/NOTES.md).
Levers per block: the first `offload_layers` blocks keep their tensors in pinned host memory, the first
`keep_attention_layers` keep attention's output + lse (so their backward skips attention's forward); with LoRA,
the last `keep_mlp_layers` keep their MLP's gate and up outputs on the GPU (so their backward skips those GEMMs).

Qwen3.5 (qwen3_5.py): attention FLOPs and kept attention outputs in its attention layers only (their rate by
head_dim, 256 measured apart), the gated q_proj and the DeltaNet projections in the GEMMs and LoRA counts, and two
constants for the DeltaNet layers read off one measured run (their rule's time per token, their block's working
set per token); with deltanet_tile the working set is a piece's, for one more forward (predicted, not measured).

The FLOPs of a step are written here once: train.py's MFU counts useful_flops, the cost model the same pieces
with the work the GPU really does (see useful_flops).

Qwen3-MoE (and Qwen3.5-MoE, whose sparse blocks add a shared expert every token meets): memory counts every expert
(stored, sharded, given AdamW states); FLOPs count the router and the top_k experts a token goes to. Every constant
was fitted to dense runs: for a MoE the prediction assumes the grouped GEMMs run at the dense GEMM rate and the
routing costs nothing beyond the per-token term, neither measured yet.

LoRA (lora.py): the frozen base costs act_bytes a parameter (sharded), or NF4_BYTES for the blocks' projections and
experts with --quantize nf4 (held whole on every rank), and has no gradient, no AdamW state and no weight-gradient GEMM;
only the adapters train. The adapters are timed by the memory they move, not by their FLOPs (rank-16 GEMMs over
[T, width] activations are bandwidth-bound), and NF4 by its dequantizations: both from measured runs
(bench/NOTES.md, "The LoRA step, measured against the plan").
"""
import argparse
import os
from dataclasses import dataclass, replace

import torch

from million.documents import document_area, parse_doc_lens
from million import hf
from model import Qwen3Config, pinned_size


@dataclass(frozen=True)
class Constants:
    """The cost model's measured rates and sizes. bench/fit_plan.py fits them to bench/results/ (relative least
    squares) and prints each run's error; bench/NOTES.md has the fit and the runs outside it."""
    attn_tflops: dict                   # attention kernels, forward and backward, by backend
    gemm_tflops: float                  # projections, MLP and the loss's matmuls
    other_s_per_mtoken_layer: float     # seconds per layer per million tokens on the rank, for everything else
    work_bytes_per_token_hidden: float  # the working set of a block's recompute and backward, per token per hidden
    ring_bytes_per_token_qdim: float    # with cp > 1: the ring's fp32 output and dq accumulators (8) and K/V in flight
    sr_s_per_gparam: float = 0.0        # seconds per billion parameters on the rank for the stochastic-rounding AdamW
                                        # step (optim.py: elementwise kernels and random bits in chunks; fused fp32
                                        # AdamW's step is within the fit's other terms)
    moe_s_per_mslot_layer: float = 0.0  # Qwen3-MoE: seconds per million routed (token, expert) pairs per sparse layer
                                        # beyond the experts' GEMM FLOPs: routing, permutation, gathers, tile sums
    adapter_ps_per_token_width: float = 0.0  # LoRA: picoseconds per token per unit of an adapted projection's
                                        # in + out width, for its adapter's passes in a step (forward, recompute,
                                        # backward), beyond the frozen GEMMs' time and the adapters' own FLOPs
    nf4_s_per_gparam: float = 0.0       # QLoRA: seconds per billion NF4 weights per step (their dequantizations)
    deltanet_s_per_mtoken_layer: float = 0.0  # Qwen3.5: seconds per million tokens on the rank per Gated DeltaNet
                                        # layer for its rule and conv in a step (forward, recompute, backward: fla's
                                        # kernels), beyond its projections' GEMMs and the per-token term
    deltanet_work_bytes_per_token: float = 0.0  # Qwen3.5: a DeltaNet block's working set in its recompute and
                                        # backward, per token (its projections' outputs and fla's buffers)
    deltanet_cp_s_per_mtoken_layer: float = 0.0  # Qwen3.5 under cp: what the span summaries add to the rate
                                        # above (each rank's rule runs with dk more value columns, from a state)


FITTED = Constants(attn_tflops=dict(cudnn=527.7, fa4=610.0,  # kernel benchmark: cuDNN 539-555, FA4 621-622
                                    # head_dim 256 (Qwen3.5), not fitted: bench/fa4_attn.py's causal forward +
                                    # backward at 65,536 tokens (bench/results/fa4_attn_d256.json)
                                    cudnn_d256=409.9, fa4_d256=435.5),
                   gemm_tflops=641.3,                           # profile: ~700
                   # the working set: fitted on runs less the recomputed block's output they held (bench/fit_plan.py)
                   other_s_per_mtoken_layer=0.099, work_bytes_per_token_hidden=27.0, ring_bytes_per_token_qdim=7.95,
                   sr_s_per_gparam=0.1, moe_s_per_mslot_layer=0.081,  # these two: three MoE runs (bench/NOTES.md)
                   # bench/lora_linear.py's adapter time over the frozen GEMM less the adapter FLOPs (2.8 ps per
                   # token per width, forward and backward) x 1.3 for the recompute's forward; NF4: QLoRA's 131k
                   # step over LoRA's, 0.72 s for 6.95 B NF4 weights
                   adapter_ps_per_token_width=3.6, nf4_s_per_gparam=0.104,
                   # Qwen3.5 9B on one H200, fla and FA4, LoRA r16 at 131,072 tokens: the step's time and peak less
                   # the rest of this model (bench/NOTES.md, "The 131k steps with fla's conv and the rule inputs
                   # inside fla"). Before, with F.conv1d and the rule inputs eager, the same fit gave 1.365 s and
                   # 269 KB (tests/test_plan.py still checks those runs with them)
                   deltanet_s_per_mtoken_layer=0.465, deltanet_work_bytes_per_token=224e3,
                   # bench/deltanet_layer.py on one H200 at 131,072 tokens (a rank's share of 1M on 8): fla's rule in
                   # its cp form costs 70.9 ms a layer-step (forward, backward, one more forward) against 42.0 ms
                   deltanet_cp_s_per_mtoken_layer=0.221)
GPU_MARGIN, HOST_MARGIN = 0.92, 0.90  # plan to these fractions of the capacities: the fit's error (<= 6% on
                                      # the fitted runs) and the allocator's cache beyond the allocated peak
                                      # (1.6-2.8 GiB measured with expandable segments, which train.py asks
                                      # for; 6-16 GiB without); the memory the OS and page cache need
# What fla's Triton kernels (Qwen3.5's DeltaNet layers) hold on the GPU outside PyTorch's allocator during a run,
# which appears after the plan reads the free memory: the local memory (spills) of the configs its autotuner kept.
# Its autotuner's trials reserve 6.5 GiB more at the start-up check, which qwen3_5.build gives back
# (deltanet.local_memory_returned). Measured on an H100 (bench/gpu_overhead.py, 2026-12-07): 308 MiB after the
# check and a forward and backward at 131,072 tokens on the kept configs; rounded up to 0.5 GiB for the variants
# not measured (from a state, the cp form's dk more value columns). Taken off the card before the plan is fitted.
FLA_OUTSIDE_BYTES = 0.5 * 2**30
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
TIME_SLACK = 0.01  # --fit auto trades up to 1% of predicted step time for the lowest GPU peak
ADAPTER_RECOMPUTE = 0.3 / 1.3  # the recompute's forward's share of an adapter's time (adapter_ps_per_token_width)
NF4_BYTES = 0.5 + 1 / 64 + 2 / (64 * 256)  # torchao's NF4: 4 bits, an int8 absmax per 64, a bf16 factor per 256 of them
LORA_HINT_RANK = 16  # the rank --fit auto suggests when only LoRA would fit
DELTANET_TILE = 16384  # the pieces --fit auto cuts Qwen3.5's DeltaNet layers into when nothing fits whole


@dataclass(frozen=True)
class Shape:
    """What the cost depends on, from the model config and the run's flags."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    seq_len: int             # the whole sequence, over its cp ranks
    cp: int
    world: int
    ranks_per_node: int
    param_bytes: int = 4     # param_dtype: fp32 master weights by default
    act_bytes: int = 2       # compute dtype (bf16)
    loss_chunk: int = 2048
    attn_backend: str = "cudnn"  # a key of FITTED.attn_tflops ("flash", never measured, is timed as cudnn)
    # Qwen3-MoE: `sparse_layers` of the layers have `experts` SwiGLU experts of width `moe_intermediate` and a
    # router, each token going to `top_k` of them; the other layers have the dense MLP. All 0 for a dense Qwen3.
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0
    shared_intermediate: int = 0  # Qwen3.5-MoE: the width of the shared expert beside the routed ones (and its gate)
    # Packed documents: the busiest rank's share of the attention a full causal window gives it (document_area);
    # 1 for one sequence. Attention's time scales with it; nothing else does.
    attn_area: float = 1.0
    stochastic_rounding: bool = False  # the optimizer: bf16 AdamW with stochastic rounding (optim.py), else fused
    # LoRA (lora.py): adapters of lora_rank on lora_targets (projection names); 0 = a full fine-tune
    lora_rank: int = 0
    lora_targets: tuple = ()
    quantize: str = ""       # "nf4": the frozen projections in NF4
    # Qwen3.5 (qwen3_5.py): the layers at attention_at are gated attention (q_proj twice as wide: query and gate),
    # the others Gated DeltaNet of dn = (key heads, value heads, key dim, value dim, conv kernel); () = every layer
    # attention
    attention_at: tuple = ()
    dn: tuple = (0, 0, 0, 0, 0)
    outside_bytes: float = 0.0  # GPU memory the kernels take outside PyTorch's allocator after the plan is made

    @classmethod
    def of(cls, mcfg: Qwen3Config, seq_len, cp, world, ranks_per_node, param_bytes=4, act_bytes=2,
           loss_chunk=2048, attn_backend="cudnn", stochastic_rounding=False, lora_rank=0, lora_targets=(),
           quantize="", deltanet_kernel="fla"):
        sparse = sum(map(mcfg.sparse, range(mcfg.num_hidden_layers))) if hasattr(mcfg, "sparse") else 0
        moe = (mcfg.num_experts, mcfg.num_experts_per_tok, mcfg.moe_intermediate_size, sparse,
               getattr(mcfg, "shared_expert_intermediate_size", 0)) if sparse else (0,) * 5
        types = getattr(mcfg, "layer_types", None) or ()  # Qwen3.5's
        hybrid = dict(attention_at=tuple(i for i, t in enumerate(types) if t == "full_attention"),
                      dn=(mcfg.linear_num_key_heads, mcfg.linear_num_value_heads, mcfg.linear_key_head_dim,
                          mcfg.linear_value_head_dim, mcfg.linear_conv_kernel_dim),
                      outside_bytes=FLA_OUTSIDE_BYTES if deltanet_kernel == "fla" else 0.0) if types else {}
        return cls(mcfg.num_hidden_layers, mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_attention_heads,
                   mcfg.num_key_value_heads, mcfg.head_dim, mcfg.vocab_size, mcfg.tie_word_embeddings, seq_len, cp,
                   world, ranks_per_node, param_bytes, act_bytes, loss_chunk,
                   attn_backend if attn_backend in FITTED.attn_tflops else "cudnn", *moe,
                   stochastic_rounding=stochastic_rounding, lora_rank=lora_rank,
                   lora_targets=tuple(lora_targets) if lora_rank else (), quantize=quantize if lora_rank else "",
                   **hybrid)

    @property
    def tokens(self):  # per rank
        return self.seq_len // self.cp

    @property
    def attn_layers(self):  # layers of (causal softmax) attention
        return len(self.attention_at) if self.dn[0] else self.layers

    @property
    def deltanet_layers(self):  # Qwen3.5's Gated DeltaNet layers: the others
        return self.layers - self.attn_layers

    def attn_in(self, n: int) -> int:
        """Attention layers among the first n blocks (the levers count blocks; only these keep attention)."""
        return sum(i < n for i in self.attention_at) if self.dn[0] else min(n, self.layers)

    @property
    def attention_matmul_params(self):  # a block's q, k, v and o projections (Qwen3.5: q_proj also gives the gate)
        h, qd, kvd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * qd * (3 if self.dn[0] else 2) + h * kvd * 2

    @property
    def deltanet_matmul_params(self):  # a DeltaNet block's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
        return sum(i * o for i, o in deltanet_projections(self).values())

    @property
    def moe_params(self):  # a sparse block's experts and router (and shared expert with its gate): what is stored
        return self.experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts + self.shared_params

    @property
    def moe_active_params(self):  # ... and what multiplies each token: top_k experts and the router (and shared)
        return self.top_k * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts + self.shared_params

    @property
    def shared_params(self):  # Qwen3.5-MoE's shared expert and its gate, per sparse block
        return 3 * self.hidden * self.shared_intermediate + self.hidden if self.shared_intermediate else 0

    @property
    def blocks_matmul_params(self):  # every block's projections and MLP a token meets (in MoE: its top_k experts)
        dense = self.layers - self.sparse_layers
        return (self.attn_layers * self.attention_matmul_params + dense * 3 * self.hidden * self.intermediate
                + self.deltanet_layers * self.deltanet_matmul_params
                + self.sparse_layers * self.moe_active_params)

    def _params(self, moe):
        dense, (nk, nv, dk, dv, conv) = self.layers - self.sparse_layers, self.dn
        norms = 2 * self.hidden + 2 * self.head_dim  # the two RMSNorms and the QK-norms
        # a DeltaNet block: its two RMSNorms, the conv's weights, A_log and dt_bias, the gated norm
        deltanet = self.deltanet_matmul_params + 2 * self.hidden + (2 * nk * dk + nv * dv) * conv + 2 * nv + dv
        return (self.attn_layers * (self.attention_matmul_params + norms) + self.deltanet_layers * deltanet
                + dense * 3 * self.hidden * self.intermediate
                + self.sparse_layers * moe + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden)

    @property
    def params(self):  # stored (and sharded, and given AdamW states): every expert
        return self._params(self.moe_params)

    @property
    def active_params(self):  # those one token uses: top_k experts per sparse layer
        return self._params(self.moe_active_params)

    def lora_shape(self, rank=LORA_HINT_RANK, quantize="") -> "Shape":
        """This shape with adapters of `rank` on every projection lora.py adapts by default (a MoE's routed experts
        left out, as PEFT's all-linear leaves them; Qwen3-MoE's MLP targets are refused, Qwen3.5-MoE's adapt its
        shared expert)."""
        return replace(self, lora_rank=rank, quantize=quantize, lora_targets=tuple(
            t for t in projection_widths(self) if not (self.sparse_layers and not self.dn[0] and t in MLP_NAMES))
            + tuple(deltanet_projections(self)))

    def _lora_params(self, experts):
        dense, widths = self.layers - self.sparse_layers, projection_widths(self)
        deltanet = {t: i + o for t, (i, o) in deltanet_projections(self).items()} if self.dn[0] else {}
        # in + out of each projection of a sparse block's shared expert (Qwen3.5-MoE), what the MLP names adapt there
        shared = self.hidden + self.shared_intermediate if self.shared_intermediate else 0
        # the routed experts (lora.LoRAExperts): gate_up's H + 2 I and down's I + H for each of `experts` experts
        routed = experts * (2 * self.hidden + 3 * self.moe_intermediate) * self.sparse_layers
        return self.lora_rank * (
            sum(widths.get(t, 0) * dense + shared * self.sparse_layers if t in MLP_NAMES else
                widths.get(t, 0) * self.attn_layers for t in self.lora_targets if t != "experts")
            + sum(deltanet.get(t, 0) * self.deltanet_layers for t in self.lora_targets)
            + (routed if "experts" in self.lora_targets else 0))

    @property
    def lora_params(self):  # the adapters: r x (in + out) for each adapted projection of each layer (every expert)
        return self._lora_params(self.experts)

    @property
    def lora_active_params(self):  # those a token meets: the routed experts' of its top_k alone
        return self._lora_params(self.top_k)

    @property
    def trained_params(self):  # what has gradients and AdamW states
        return self.lora_params if self.lora_rank else self.params

    @property
    def routed_params(self):  # every sparse block's routed experts
        return self.sparse_layers * self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def nf4_params(self):  # with --quantize nf4: the blocks' projections, routed and shared experts (not the
        # routers, embedding or head)
        dense = self.layers - self.sparse_layers
        return (self.attn_layers * self.attention_matmul_params + self.deltanet_layers * self.deltanet_matmul_params
                + dense * 3 * self.hidden * self.intermediate + self.routed_params
                + self.sparse_layers * 3 * self.hidden * self.shared_intermediate) if self.quantize else 0


def projection_widths(s: Shape) -> dict:
    """in + out of each attention block's projection and of the MLP's, by name."""
    h, q, kv, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    return dict(q_proj=h + q * (2 if s.dn[0] else 1), k_proj=h + kv, v_proj=h + kv, o_proj=q + h, gate_proj=h + i,
                up_proj=h + i, down_proj=i + h)


def deltanet_projections(s: Shape) -> dict:
    """(in, out) of a Gated DeltaNet block's projections, by name; empty for a model without them."""
    nk, nv, dk, dv, _ = s.dn
    if not nk:
        return {}
    h = s.hidden
    return dict(in_proj_qkv=(h, 2 * nk * dk + nv * dv), in_proj_z=(h, nv * dv), in_proj_b=(h, nv),
                in_proj_a=(h, nv), out_proj=(nv * dv, h))


@dataclass(frozen=True)
class Levers:
    offload_layers: int          # blocks (the first ones) whose kept tensors live in pinned host memory; 0 = none
    keep_attention_layers: int   # blocks (the first ones) that keep attention's output + lse; 0 = none
    tiled_mlp: bool = True
    mlp_tile: int = 16384
    keep_mlp_layers: int = 0     # LoRA: blocks (the last ones) that keep gate's and up's outputs on the GPU
    deltanet_tile: int = 0       # Qwen3.5 at cp 1: tokens per piece of each DeltaNet layer (0: the whole sequence)


@dataclass(frozen=True)
class Cost:
    gpu_gib: float       # peak GPU memory per rank
    host_gib: float      # pinned host memory per rank
    step_s: float


# --- FLOPs -----------------------------------------------------------------------------------------

def matmul_params(s: Shape) -> int:
    """Parameters that multiply every token: the blocks' projections and MLPs (in a MoE block the router and the
    token's top_k experts, not the others), and the head (embedding lookups and norms are not matmuls)."""
    return s.blocks_matmul_params + s.hidden * s.vocab


def attention_fwd_flops(s: Shape) -> int:
    """Causal attention's forward over the whole sequence: QK^T and PV, 2 FLOPs a multiply-add each, over half
    the [seq_len x seq_len] square, in every attention layer (Qwen3.5's DeltaNet layers: none; their rule's own
    FLOPs, about 3% of such a layer's projections, are not counted)."""
    return 2 * s.seq_len ** 2 * s.heads * s.head_dim * s.attn_layers


def useful_flops(s: Shape) -> float:
    """FLOPs of one sequence (over all its cp ranks), forward + backward, as MFU counts them: 2 per matmul
    parameter per token forward, twice that backward, and causal attention x3.

    MFU counts the work the model needs, so that it compares with other trainers; the cost model (step_seconds)
    counts the work the GPU does: the recompute's forward again (the blocks' matmuls, and attention in blocks
    that do not keep it), and attention's backward at 2.5x its forward, as the kernels run it (they recompute
    the scores)."""
    return float(6 * matmul_params(s) * s.seq_len + 3 * attention_fwd_flops(s))


def attention_flops(s: Shape, lv: Levers) -> float:
    """Attention FLOPs the busiest rank runs in a step: forward, backward (2.5x), and the forward again in the
    blocks that recompute it; with packed documents, only the mask's area (attn_area)."""
    recomputed = (s.attn_layers - s.attn_in(lv.keep_attention_layers)) / s.attn_layers
    return attention_fwd_flops(s) / s.cp * (1 + 2.5 + recomputed) * s.attn_area


def gemm_flops(s: Shape, lv: Levers | None = None) -> float:
    """GEMM FLOPs one rank runs in a step: the blocks' forward, backward (2x) and the recompute's forward; the
    head's forward and backward, never recomputed (the loss runs it once). With LoRA the frozen weights get no
    gradient (the backward's dX GEMM alone: blocks 3x, head 2x), and the adapters all four passes (their time is
    mostly memory traffic: adapter_seconds); a block that keeps its MLP's gate and up outputs does not run them
    again in its backward (nor their adapters' B products). The tiled MLP's backward does not run the down
    projection's forward again either: left in the count, as in the runs the GEMM rate was fitted to."""
    if s.lora_rank:
        adapted = sum(t in s.lora_targets for t in ("gate_proj", "up_proj"))
        kept = (lv.keep_mlp_layers if lv else 0) * (2 * s.hidden + adapted * s.lora_rank) * s.intermediate
        return 2 * s.tokens * (3 * s.blocks_matmul_params + 2 * s.hidden * s.vocab + 4 * s.lora_active_params - kept)
    return 2 * s.tokens * (4 * s.blocks_matmul_params + 3 * s.hidden * s.vocab)


# --- memory and time -------------------------------------------------------------------------------

def kept_bytes(s: Shape):
    """Per block, for this rank's tokens: (its input, attention's output, attention's fp32 lse), each a tensor."""
    return (s.tokens * s.hidden * s.act_bytes, s.tokens * s.heads * s.head_dim * s.act_bytes,
            s.tokens * s.heads * 4)


def kept_mlp_bytes(s: Shape) -> int:
    """Per block that keeps its MLP's gate and up outputs (LoRA): the two [tokens, intermediate] tensors."""
    return 2 * s.tokens * s.intermediate * s.act_bytes


def host_bytes(s: Shape, lv: Levers, pinned: bool = True) -> float:
    """Pinned host memory per rank: the offloaded blocks' input, and attention's output and fp32 lse where they
    also keep attention; each a buffer of its own, in whole pages (pinned=False: the tensors' bytes)."""
    size = pinned_size if pinned else int
    x, out, lse = kept_bytes(s)
    return lv.offload_layers * size(x) + s.attn_in(min(lv.keep_attention_layers, lv.offload_layers)) * (
        size(out) + size(lse))


def gpu_bytes(s: Shape, lv: Levers, k: Constants = FITTED) -> float:
    """The peak comes where the gradients meet the blocks' kept tensors. The backward frees a block's kept tensors
    as it makes that block's gradients, so the two overlap by about one block, and the peak holds the larger of
    the two, not their sum (for a run that keeps every block on the GPU: the kept tensors at the end of the
    forward; for one that offloads every block: the gradients at the end of the backward)."""
    x, out, lse = kept_bytes(s)
    attn = out + lse
    state = 3 * s.param_bytes * s.trained_params / s.world      # weights and AdamW's two moments
    grads = s.param_bytes * s.trained_params / s.world
    loss = 4 * s.vocab * s.hidden + 6 * s.loss_chunk * s.vocab  # fp32 grad of the head; a chunk's logits
    if s.lora_rank:
        state += frozen_bytes(s)
        loss -= 4 * s.vocab * s.hidden                            # a frozen head has no gradient
    # Qwen3.5's gated attention's working set: about half of it as wide as its query (q_proj gives query and gate),
    # half as wide as hidden. The 35B-A3B (hidden 2048, 16 x 256 query) held 81.9 KB a token at its 458,752-token
    # peak, (2048 + 4096) / 2 within 1%; for the 9B (4096 and 4096) it is hidden, as fitted
    width = (s.hidden + s.heads * s.head_dim) / 2 if s.dn[0] else s.hidden
    work = k.work_bytes_per_token_hidden * width * s.tokens
    if s.dn[0]:  # one block at a time: the larger of the two kinds' working sets; in pieces (deltanet_tile), a
        # piece's, beside the pieces' outputs and their concatenation (predicted, not measured)
        tile = min(lv.deltanet_tile or s.tokens, s.tokens)
        pieces = 2 * s.tokens * s.hidden * s.act_bytes if tile < s.tokens else 0
        work = max(work, k.deltanet_work_bytes_per_token * tile + pieces)
    if s.cp > 1:
        work += k.ring_bytes_per_token_qdim * s.heads * s.head_dim * s.tokens
    kept_attn = max(s.attn_in(lv.keep_attention_layers) - s.attn_in(lv.offload_layers), 0)  # not offloaded
    on_gpu = (s.layers - lv.offload_layers) * x + kept_attn * attn + lv.keep_mlp_layers * kept_mlp_bytes(s)
    mlp = 0
    if not lv.tiled_mlp and s.tokens > lv.mlp_tile:  # the four [T, intermediate] tensors whole, not a tile's; for
        # a MoE block the same four [T*top_k, moe_intermediate] and the routed rows and outputs [T*top_k, hidden]
        width = max(4 * s.intermediate if s.layers > s.sparse_layers else 0,
                    s.top_k * (4 * s.moe_intermediate + 2 * s.hidden) + 4 * s.shared_intermediate)
        mlp = (s.tokens - lv.mlp_tile) * width * s.act_bytes
    # a MoE block's backward holds its experts' gradients in fp32 and a tile's in act_bytes (_TiledMoE): never
    # measured, added here as they are (1 block's worth; a dense MLP's smaller ones sit inside the fitted `work`).
    # Under LoRA the experts are frozen and get neither (their adapters' are small)
    moe = (4 + s.act_bytes) * s.moe_params if s.sparse_layers and not s.lora_rank else 0
    return state + max(grads, on_gpu) + loss + work + mlp + moe


def frozen_bytes(s: Shape) -> float:
    """A LoRA run's frozen base per rank: act_bytes a parameter, sharded; with NF4 the blocks' projections and
    experts at NF4_BYTES each, whole on every rank, and one of them dequantized while it runs (a MoE block's routed
    experts: all three stacked weights of the block)."""
    widest = max([s.hidden * (s.heads * s.head_dim * (2 if s.dn[0] else 1)), s.hidden * s.intermediate,
                  s.routed_params // max(s.sparse_layers, 1)]
                 + [i * o for i, o in deltanet_projections(s).values()]) if s.quantize else 0
    return ((s.params - s.nf4_params) * s.act_bytes / s.world + s.nf4_params * NF4_BYTES
            + widest * s.act_bytes)


def sr_gparams(s: Shape) -> float:
    """Billions of parameters the rank's stochastic-rounding AdamW updates in a step: 0 without it."""
    return s.trained_params / s.world / 1e9 if s.stochastic_rounding else 0.0


def routed_slots(s: Shape) -> int:
    """(token, expert) pairs a step routes on a rank, over the sparse layers: 0 for a dense model."""
    return s.sparse_layers * s.tokens * s.top_k


def adapter_seconds(s: Shape, lv: Levers | None = None, k: Constants = FITTED) -> float:
    """LoRA's adapters and NF4's dequantizations in a step, beyond what gemm_flops times: each adapter reads its
    projection's input and output (and their gradients) a few times over in skinny GEMMs bound by memory, a time
    proportional to tokens x (in + out), of which the recompute's forward is ADAPTER_RECOMPUTE (gate's and up's
    not run in the blocks that keep their outputs); each NF4 weight is dequantized at each pass (the routed
    experts' at two of the three: the backward takes the recompute's). 0 for a full fine-tune."""
    if not s.lora_rank:
        return 0.0
    widths = s.lora_active_params / s.lora_rank  # in + out, summed over the adapted projections a token meets
    kept = sum(projection_widths(s)[t] for t in ("gate_proj", "up_proj") if t in s.lora_targets) * (
        lv.keep_mlp_layers if lv else 0)
    return (k.adapter_ps_per_token_width * 1e-12 * s.tokens * (widths - ADAPTER_RECOMPUTE * kept)
            + k.nf4_s_per_gparam * (s.nf4_params - (s.routed_params / 3 if s.quantize else 0)) / 1e9)


def attn_rate(s: Shape, k: Constants = FITTED) -> float:
    """FLOP/s of the attention kernels: by backend, and by head_dim where measured apart (256: Qwen3.5's)."""
    return k.attn_tflops.get(f"{s.attn_backend}_d{s.head_dim}", k.attn_tflops[s.attn_backend]) * 1e12


def step_seconds(s: Shape, lv: Levers, k: Constants = FITTED) -> float:
    return (attention_flops(s, lv) / attn_rate(s, k)
            + gemm_flops(s, lv) / (k.gemm_tflops * 1e12)
            + k.other_s_per_mtoken_layer * s.layers * s.tokens / 1e6 + k.sr_s_per_gparam * sr_gparams(s)
            + k.moe_s_per_mslot_layer * routed_slots(s) / 1e6 + adapter_seconds(s, lv, k) + deltanet_seconds(s, k)
            + tiled_deltanet_seconds(s, lv, k))


def tiled_deltanet_seconds(s: Shape, lv: Levers, k: Constants = FITTED) -> float:
    """What deltanet_tile adds: each DeltaNet layer's forward once more (its projections' GEMMs, and a quarter of
    the rule's and conv's forward, recompute and backward). Predicted, not measured."""
    if not (s.dn[0] and lv.deltanet_tile and lv.deltanet_tile < s.tokens):
        return 0.0
    gemm = 2 * s.tokens * s.deltanet_layers * s.deltanet_matmul_params / (k.gemm_tflops * 1e12)
    return gemm + deltanet_seconds(s, k) / 4


def deltanet_seconds(s: Shape, k: Constants = FITTED) -> float:
    """Qwen3.5's DeltaNet rule and conv in a step, at a rate per token and layer measured on one GPU. Under
    context parallelism each rank's rule runs with dk more value columns (deltanet.py's span summaries), at a rate
    measured alone (the 9B's dk = dv = 128; other head dims are assumed, not measured, to scale it by dk / dv, as
    the extra columns do); the all-gather of the summaries is a few MB, not counted."""
    nk, nv, dk, dv, _ = s.dn
    if not nk:
        return 0.0
    summaries = k.deltanet_cp_s_per_mtoken_layer * dk / dv if s.cp > 1 else 0.0
    return (k.deltanet_s_per_mtoken_layer + summaries) * s.deltanet_layers * s.tokens / 1e6


def forward_seconds(s: Shape, k: Constants = FITTED) -> float:
    """One forward with nothing kept for a backward (an evaluation): attention's forward, the blocks' GEMMs once,
    and a third of the per-token term (fitted to whole steps; how it splits over their passes was not measured).
    About a third of a step that recomputes nothing."""
    return (attention_fwd_flops(s) / s.cp * s.attn_area / attn_rate(s, k)
            + 2 * s.tokens * s.blocks_matmul_params / (k.gemm_tflops * 1e12)
            + k.other_s_per_mtoken_layer * s.layers * s.tokens / 1e6 / 3 + deltanet_seconds(s, k) / 4)


def predict(s: Shape, lv: Levers, k: Constants = FITTED) -> Cost:
    return Cost(gpu_bytes(s, lv, k) / 2**30, host_bytes(s, lv) / 2**30, step_seconds(s, lv, k))


# --- the plan --------------------------------------------------------------------------------------

class NoFit(Exception):
    """No set of levers fits; the message names the nearest plan and what would make it fit."""


def choose(s: Shape, gpu_gib: float, host_gib_per_node: float, fixed: dict | None = None,
           k: Constants = FITTED) -> tuple[Levers, Cost]:
    """The levers predicted to fit within GPU_MARGIN of gpu_gib per rank (less what the kernels will hold outside
    PyTorch's allocator, s.outside_bytes) and HOST_MARGIN of the node's host memory (shared by ranks_per_node
    ranks): among the plans within TIME_SLACK of the fastest, the one with the
    lowest GPU peak, then the fastest, then the least pinned host memory. Headroom that costs no time is taken: a
    run near the GPU's limit is exposed to fragmentation and to anything else on the card. `fixed` holds the
    levers the user set, which win.

    Time depends only on how many blocks keep attention, so the fastest plans keep the most; offloading more
    blocks lowers the peak until the gradients, not the kept tensors, set it (gpu_bytes). With LoRA (dense
    models) the GPU memory that plan leaves then goes to blocks that keep their MLP's gate and up outputs, each
    a few tenths of a percent of the step for 2 x T x intermediate values: the most that fit, if together they
    save more than TIME_SLACK of the step (else the headroom is worth more)."""
    fixed = fixed or {}
    gpu_cap = GPU_MARGIN * gpu_gib * 2**30 - s.outside_bytes
    host_cap = HOST_MARGIN * host_gib_per_node * 2**30 / s.ranks_per_node
    base = Levers(s.layers, s.layers, fixed.get("tiled_mlp", True), fixed.get("mlp_tile", 16384),
                  fixed.get("keep_mlp_layers", 0), fixed.get("deltanet_tile", 0))
    keeps = [fixed["keep_attention_layers"]] if "keep_attention_layers" in fixed else range(s.layers, -1, -1)
    offs = [fixed["offload_layers"]] if "offload_layers" in fixed else range(0, s.layers + 1)
    # Qwen3.5 at cp 1: DeltaNet layers in pieces of DELTANET_TILE tokens, where nothing fits without them
    tiles = [base.deltanet_tile] if "deltanet_tile" in fixed or not s.dn[0] or s.cp > 1 else [0, DELTANET_TILE]
    def candidates(tile):
        return (replace(base, offload_layers=off, keep_attention_layers=keep, deltanet_tile=tile)
                for keep in keeps for off in offs)

    def fit(x: Shape, lv: Levers):
        return gpu_bytes(x, lv, k) <= gpu_cap and host_bytes(x, lv) <= host_cap
    fits = []
    for tile in tiles:
        fits = fits or [lv for lv in candidates(tile) if fit(s, lv)]
    if fits:
        fastest = min(step_seconds(s, lv, k) for lv in fits)
        near = [lv for lv in fits if step_seconds(s, lv, k) <= fastest * (1 + TIME_SLACK)]
        best = min(near, key=lambda lv: (gpu_bytes(s, lv, k), step_seconds(s, lv, k), host_bytes(s, lv)))
        if s.lora_rank and not s.sparse_layers and "keep_mlp_layers" not in fixed:
            # then the GPU memory left buys back the MLP's recompute: as many blocks as fit keep gate and up,
            # beside the two offloaded blocks' tensors a backward has on the GPU (the block in backward and the
            # one fetched ahead), which the working set fitted to full fine-tunes leaves out (bench/NOTES.md)
            x, out, lse = kept_bytes(s)
            pair = 2 * (x + out + lse) if best.offload_layers else 0
            n = [n for n in range(s.layers + 1) if gpu_bytes(s, replace(best, keep_mlp_layers=n), k) + pair <= gpu_cap]
            kept = replace(best, keep_mlp_layers=max(n, default=0))
            # ... where that is worth the headroom: more than TIME_SLACK of the step, as the rule above weighs it
            if step_seconds(s, kept, k) < step_seconds(s, best, k) * (1 - TIME_SLACK):
                best = kept
        return best, predict(s, best, k)
    nearest = replace(base, offload_layers=offs[-1], keep_attention_layers=keeps[-1], deltanet_tile=tiles[-1])
    c = predict(s, nearest, k)
    def fits_with(x: Shape):  # some set of levers fits x (the DeltaNet in pieces at cp 1 only)
        return any(fit(x, lv) for tile in (tiles if x.cp == 1 else tiles[:1]) for lv in candidates(tile))
    need_cp = next((cp for cp in (2, 4, 8, 16, 32, 64) if cp > s.cp and s.seq_len % (2 * cp) == 0 and
                    fits_with(replace(s, cp=cp, world=s.world * cp // s.cp))), None)
    gpu_short = gpu_bytes(s, nearest, k) > gpu_cap
    def longest(x: Shape):  # the longest of seq_len / 2, / 4, ... at which x fits, then up from it in steps of
        # the largest power of two within a quarter of it (524,288 -> 262,144 -> 393,216), below seq_len
        n = next((n for n in (x.seq_len >> i for i in range(1, 11)) if n and n % (2 * x.cp) == 0
                  and fits_with(replace(x, seq_len=n))), None)
        if n is None:
            return None
        step = 1 << (max(n // 4, 1).bit_length() - 1)
        return next((m for m in range((min(2 * n, x.seq_len) - 1) // step * step, n, -step)
                     if m % (2 * x.cp) == 0 and fits_with(replace(x, seq_len=m))), n)
    shorter = longest(s)
    hints = [f"--cp {need_cp} (more GPUs per sequence)"] if need_cp else []
    hints += [f"--seq_len {shorter}" if shorter else "a shorter --seq_len", "more GPUs" if gpu_short else
              "more host memory"]
    if gpu_short and s.param_bytes == 4 and not s.lora_rank:
        hints.append(f"--param_dtype bfloat16 --stochastic_rounding true (state {4 * s.param_bytes} -> 8 bytes per "
                     "parameter, updates kept on average)")
    if gpu_short and not s.lora_rank:  # LoRA or QLoRA, whichever fits the longer sequence (LoRA on a tie)
        fit = [(s.seq_len if fits_with(x) else longest(x), q) for q in ("", "nf4") for x in [s.lora_shape(quantize=q)]]
        length, q = max(fit, key=lambda f: (f[0] or 0, not f[1]))
        if length:
            hints.append(f"--lora_rank {LORA_HINT_RANK}" + (" --quantize nf4" if q else "")
                         + (f" --lora_targets {','.join(s.lora_shape().lora_targets)}"
                            if s.sparse_layers and not s.dn[0] else "")  # Qwen3-MoE: no MLP targets
                         + (f" --seq_len {length}" if length != s.seq_len else "")
                         + " (LoRA: the model frozen, only adapters trained)")
    elif gpu_short and not s.quantize and fits_with(replace(s, quantize="nf4")):
        hints.append("--quantize nf4 (QLoRA: the frozen projections and experts in 4 bits)")
    raise NoFit(f"no set of levers fits: the nearest (offload_layers {nearest.offload_layers}, keep_attention_layers "
                f"{nearest.keep_attention_layers}) needs {c.gpu_gib:.1f} GiB of GPU memory per rank (plan limit "
                f"{gpu_cap / 2**30:.1f} of {gpu_gib:.1f}) and {c.host_gib * s.ranks_per_node:.0f} GiB of host memory "
                f"per node (limit {host_cap * s.ranks_per_node / 2**30:.0f} of {host_gib_per_node:.0f}). To fit: "
                + ", ".join(hints[:-1]) + ", or " + hints[-1])


def describe(lv: Levers, c: Cost, s: Shape) -> str:
    mlp = f", keep_mlp_layers {lv.keep_mlp_layers}/{s.layers}" if s.lora_rank else ""
    mlp += f", deltanet_tile {lv.deltanet_tile}" if lv.deltanet_tile else ""
    return (f"offload_layers {lv.offload_layers}/{s.layers}, keep_attention_layers {lv.keep_attention_layers}/"
            f"{s.layers}{mlp}, tiled_mlp {lv.tiled_mlp} -> predicted {c.step_s:.1f} s/step, {c.gpu_gib:.1f} GiB GPU "
            f"per rank, {c.host_gib:.1f} GiB pinned host per rank ({c.host_gib * s.ranks_per_node:.0f} GiB per node)")


# --- capacities of this machine ------------------------------------------------------------------

def host_memory_gib() -> float:
    """Physical memory, or the cgroup's limit when lower (a container's or a Slurm job's)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(f).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total / 2**30


def gpu_memory_gib() -> float:
    """Free memory of this rank's GPU now (before the model is built)."""
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench/configs/qwen3-8b")
    ap.add_argument("--seq_len", type=int, default=1_048_576)
    ap.add_argument("--nproc", type=int, default=8, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--cp", type=int, default=0, help="0: all GPUs")
    ap.add_argument("--param_dtype", default="float32")
    ap.add_argument("--stochastic_rounding", default="false", choices=["true", "false"])
    ap.add_argument("--attn_backend", default="cudnn", choices=sorted(FITTED.attn_tflops), help="the kernels timed")
    ap.add_argument("--gpu_mem_gib", type=float, default=74.5, help="per GPU (80 GB = 74.5 GiB)")
    ap.add_argument("--host_mem_gib", type=float, default=1907, help="per node (2 TB = 1907 GiB)")
    ap.add_argument("--doc_lens", default="", help="a packed window's documents (e.g. 4x65536 or 8192,16384,...): "
                    "time its masked attention (balanced as train.py shards it); default one sequence")
    ap.add_argument("--lora_rank", type=int, default=0, help="adapters of this rank on every projection; 0: off")
    ap.add_argument("--quantize", default="", choices=["", "nf4"], help="with --lora_rank: the frozen base in NF4")
    a = ap.parse_args()
    world = a.nproc * a.nodes
    s = Shape.of(hf.read_config(a.model), a.seq_len, a.cp or world, world, a.nproc,
                 param_bytes=4 if a.param_dtype == "float32" else 2, attn_backend=a.attn_backend,
                 stochastic_rounding=a.stochastic_rounding == "true")
    if a.lora_rank:
        s = s.lora_shape(a.lora_rank, a.quantize)
    try:
        if a.doc_lens:
            docs = parse_doc_lens(a.doc_lens)
            if sum(docs) != a.seq_len:
                raise ValueError(f"--doc_lens sum to {sum(docs)}, not to --seq_len {a.seq_len}")
            s = replace(s, attn_area=document_area(docs, s.cp))
            print(f"documents: {len(docs)}, attention area {s.attn_area:.4f} of a full causal window's (busiest rank)")
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    try:
        lv, c = choose(s, a.gpu_mem_gib, a.host_mem_gib)
        print(describe(lv, c, s))
    except NoFit as e:
        raise SystemExit(f"error: {e}")
