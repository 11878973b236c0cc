"""What one training step costs per rank, and the fastest set of memory levers that fits a node.

    python plan.py --model bench/configs/qwen3-8b --seq_len 1048576 --nproc 8 --gpu_mem_gib 74.5 --host_mem_gib 1907
    python plan.py --fit         # re-fit the constants below to the runs in bench/results/ and print the errors
    python plan.py --check       # the errors out of sample (leave one out, and runs no fit has seen)

A plain arithmetic model, one function per quantity, with a few constants fitted to measured runs:
- pinned host memory: exact (the tensors the offloaded blocks keep: their input, and attention's output + lse,
  each rounded up to a power of two as torch's pinned allocator rounds it);
- peak GPU memory: FSDP2 state (weights and AdamW's two moments, each 1/world of the model in param_dtype) +
  the larger of the gradients and what stays on the GPU for blocks that are not offloaded + the chunked loss's
  buffers + a working set per token (and the ring's buffers when cp > 1);
- step time: attention FLOPs at a measured rate per kernel backend + GEMM FLOPs at a measured rate + a
  per-token-per-layer term for everything else (norms, RoPE, SwiGLU, copies). The ring's overhead is left out:
  it measured 97-103% of the ideal split (bench/NOTES.md).
Levers per block: the first `offload_layers` blocks keep their tensors in pinned host memory, the first
`keep_attention_layers` keep attention's output + lse (so their backward skips attention's forward).

Its own file because train.py uses it before the first step (--fit auto), bench/ prints its predictions beside
measurements, and it reads on its own: "how much does a million-token step need?" has this one answer.
"""
import json
import os
from dataclasses import dataclass, replace

import model as M
from model import pinned_size

# Fitted by fit() (`python plan.py --fit`) to the runs in FIT_FILES: relative least squares. Their errors are
# printed by `python plan.py --fit`; runs outside the fit by `python plan.py --check` (bench/NOTES.md has both).
ATTN_TFLOPS = dict(cudnn=527.6, fa4=610.6)  # attention kernels, forward and backward, by backend (kernel
                                            # benchmark: cuDNN 539-555, FA4 621-622 TFLOP/s)
GEMM_TFLOPS = 642.0          # projections, MLP and the loss's matmuls (profile: ~700)
OTHER_S_PER_MTOKEN_LAYER = 0.099   # seconds per layer per million tokens on the rank, for everything else
WORK_BYTES_PER_TOKEN_HIDDEN = 28.5  # the working set of a block's recompute and backward, per token per hidden
RING_BYTES_PER_TOKEN_QDIM = 9.16   # with cp > 1: the ring's fp32 output and dq accumulators (8) and K/V in flight
GPU_MARGIN, HOST_MARGIN = 0.92, 0.90  # plan to these fractions of the capacities: the fit's error (<= 6% on
                                      # the runs above) and the memory the OS and page cache need
FIT_FILES = ("train_steps_v6.json", "train_steps_fp32_v6.json", "longest_4b.json", "x2_c2ce9fc.json",
             "train_steps_fa4_v7.json", "train_steps_4b_fa4_v7.json", "plan_check.json")
CHECK_FILES = ("plan_check_4b_fp32.json", "plan_check_8b_524k.json")  # never fitted: see check()


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
    seq_len: int
    cp: int
    world: int
    ranks_per_node: int
    param_bytes: int = 4     # param_dtype: fp32 master weights by default
    act_bytes: int = 2       # compute dtype (bf16)
    loss_chunk: int = 2048
    attn_backend: str = "cudnn"  # a key of ATTN_TFLOPS ("flash", never measured, is timed as cudnn)

    @classmethod
    def of(cls, mcfg, seq_len, cp, world, ranks_per_node, param_bytes=4, act_bytes=2, loss_chunk=2048,
           attn_backend="cudnn"):
        return cls(mcfg.num_hidden_layers, mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_attention_heads,
                   mcfg.num_key_value_heads, mcfg.head_dim, mcfg.vocab_size, mcfg.tie_word_embeddings, seq_len, cp,
                   world, ranks_per_node, param_bytes, act_bytes, loss_chunk,
                   attn_backend if attn_backend in ATTN_TFLOPS else "cudnn")

    @property
    def tokens(self):  # per rank
        return self.seq_len // self.cp

    @property
    def block_params(self):
        h, qd, kvd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * qd * 2 + h * kvd * 2 + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    @property
    def params(self):
        return self.layers * self.block_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class Levers:
    offload_layers: int          # blocks (the first ones) whose kept tensors live in pinned host memory
    keep_attention_layers: int   # blocks (the first ones) that keep attention's output + lse
    tiled_mlp: bool = True
    mlp_tile: int = 16384


@dataclass(frozen=True)
class Cost:
    gpu_gib: float       # peak GPU memory per rank
    host_gib: float      # pinned host memory per rank
    step_s: float


def kept_bytes(s: Shape):
    """Per block, for this rank's tokens: (its input, attention's output, attention's fp32 lse), each a tensor."""
    return (s.tokens * s.hidden * s.act_bytes, s.tokens * s.heads * s.head_dim * s.act_bytes,
            s.tokens * s.heads * 4)


def host_bytes(s: Shape, lv: Levers, pinned: bool = True) -> float:
    """Pinned host memory per rank: the offloaded blocks' input, and attention's output and fp32 lse where they
    also keep attention; each a buffer of its own, as the allocator holds it (pinned=False: the tensors' bytes)."""
    size = pinned_size if pinned else int
    x, out, lse = kept_bytes(s)
    return lv.offload_layers * size(x) + min(lv.keep_attention_layers, lv.offload_layers) * (size(out) + size(lse))


def gpu_bytes(s: Shape, lv: Levers) -> float:
    """The peak comes where the gradients meet the blocks' kept tensors. The backward frees a block's kept tensors
    as it makes that block's gradients, so the two overlap by about one block, and the peak holds the larger of
    the two, not their sum (for a run that keeps every block on the GPU: the kept tensors at the end of the
    forward; for one that offloads every block: the gradients at the end of the backward)."""
    x, out, lse = kept_bytes(s)
    attn = out + lse
    state = 3 * s.param_bytes * s.params / s.world              # weights and AdamW's two moments
    grads = s.param_bytes * s.params / s.world
    loss = 4 * s.vocab * s.hidden + 6 * s.loss_chunk * s.vocab  # fp32 grad of the head; a chunk's logits
    work = WORK_BYTES_PER_TOKEN_HIDDEN * s.hidden * s.tokens
    if s.cp > 1:
        work += RING_BYTES_PER_TOKEN_QDIM * s.heads * s.head_dim * s.tokens
    on_gpu = (s.layers - lv.offload_layers) * x + max(lv.keep_attention_layers - lv.offload_layers, 0) * attn
    mlp = 0
    if not lv.tiled_mlp and s.tokens > lv.mlp_tile:  # the four [T, intermediate] tensors whole, not a tile's
        mlp = 4 * (s.tokens - lv.mlp_tile) * s.intermediate * s.act_bytes
    return state + max(grads, on_gpu) + loss + work + mlp


def step_seconds(s: Shape, lv: Levers) -> float:
    T, L = s.tokens, s.layers
    attn_fwd = 2 * s.seq_len ** 2 * s.heads * s.head_dim * L / s.cp  # causal: QK^T and PV over half the square
    recomputed = (L - lv.keep_attention_layers) / L                     # blocks that run attention's forward again
    attention = attn_fwd * (1 + 2.5 + recomputed)                       # forward, backward (2.5x), recompute
    gemm = 8 * L * s.block_params * T + 6 * s.hidden * s.vocab * T     # fwd + bwd + the recompute's fwd; the head
    return (attention / (ATTN_TFLOPS[s.attn_backend] * 1e12) + gemm / (GEMM_TFLOPS * 1e12)
            + OTHER_S_PER_MTOKEN_LAYER * L * T / 1e6)


def predict(s: Shape, lv: Levers) -> Cost:
    return Cost(gpu_bytes(s, lv) / 2**30, host_bytes(s, lv) / 2**30, step_seconds(s, lv))


class NoFit(Exception):
    """No set of levers fits; the message names the nearest plan and what would make it fit."""


def choose(s: Shape, gpu_gib: float, host_gib_per_node: float, fixed: dict | None = None) -> tuple[Levers, Cost]:
    """The fastest levers predicted to fit within GPU_MARGIN of gpu_gib per rank and HOST_MARGIN of the node's
    host memory (shared by ranks_per_node ranks). `fixed` holds the levers the user set, which win.

    Time depends only on how many blocks keep attention, so try the most first; for each, offload as few blocks as
    the GPU allows (host memory and PCIe traffic are then the smallest)."""
    fixed = fixed or {}
    gpu_cap, host_cap = GPU_MARGIN * gpu_gib * 2**30, HOST_MARGIN * host_gib_per_node * 2**30 / s.ranks_per_node
    base = Levers(s.layers, s.layers, fixed.get("tiled_mlp", True), fixed.get("mlp_tile", 16384))
    keeps = [fixed["keep_attention_layers"]] if "keep_attention_layers" in fixed else range(s.layers, -1, -1)
    offs = [fixed["offload_layers"]] if "offload_layers" in fixed else range(0, s.layers + 1)
    for keep in keeps:
        for off in offs:
            lv = replace(base, offload_layers=off, keep_attention_layers=keep)
            if gpu_bytes(s, lv) <= gpu_cap:
                if host_bytes(s, lv) <= host_cap:
                    return lv, predict(s, lv)
                break  # more offload only needs more host memory
    nearest = replace(base, offload_layers=offs[-1], keep_attention_layers=keeps[-1])
    c = predict(s, nearest)
    def fits(x: Shape):
        return gpu_bytes(x, nearest) <= gpu_cap and host_bytes(x, nearest) <= host_cap
    need_cp = next((cp for cp in (2, 4, 8, 16, 32, 64) if cp > s.cp and s.seq_len % (2 * cp) == 0 and
                    fits(replace(s, cp=cp, world=s.world * cp // s.cp))), None)
    gpu_short = gpu_bytes(s, nearest) > gpu_cap
    raise NoFit(f"no set of levers fits: the nearest (offload_layers {nearest.offload_layers}, keep_attention_layers "
                f"{nearest.keep_attention_layers}) needs {c.gpu_gib:.1f} GiB of GPU memory per rank (plan limit "
                f"{gpu_cap / 2**30:.1f} of {gpu_gib:.1f}) and {c.host_gib * s.ranks_per_node:.0f} GiB of host memory "
                f"per node (limit {host_cap * s.ranks_per_node / 2**30:.0f} of {host_gib_per_node:.0f}). To fit: "
                + (f"--cp {need_cp} (more GPUs per sequence), " if need_cp else "")
                + ("a shorter --seq_len, more GPUs" if gpu_short else "a shorter --seq_len, more host memory")
                + (f", or --param_dtype bfloat16 (state {4 * s.param_bytes} -> 8 bytes per parameter)"
                   if gpu_short and s.param_bytes == 4 else ""))


def describe(lv: Levers, c: Cost, s: Shape) -> str:
    return (f"offload_layers {lv.offload_layers}/{s.layers}, keep_attention_layers {lv.keep_attention_layers}/"
            f"{s.layers}, tiled_mlp {lv.tiled_mlp} -> predicted {c.step_s:.1f} s/step, {c.gpu_gib:.1f} GiB GPU per "
            f"rank, {c.host_gib:.1f} GiB pinned host per rank ({c.host_gib * s.ranks_per_node:.0f} GiB per node)")


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
    import torch
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


# --- fitting the constants -------------------------------------------------------------------------

def measured_runs(files, root=os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench")):
    """[(Shape, Levers, s/step, peak GiB, name)] of the runs in bench/results/<files>. A run names its levers
    (offload_layers, keep_attention_layers); older files without them offloaded every block and kept attention
    unless their flags said otherwise."""
    runs = []
    for f in files:
        path = os.path.join(root, "results", f)
        if not os.path.exists(path):
            continue
        data = json.load(open(path))
        for r in data["runs"] if isinstance(data, dict) else data:
            mcfg = M.Qwen3Config.from_pretrained(os.path.join(root, "configs", r["model"]))
            extra = r.get("extra", "")
            fp32 = "float32" in extra or r.get("param_dtype") == "float32"
            backend = r.get("backend") or ("fa4" if "--attn_backend fa4" in extra else "cudnn")
            cp = r.get("cp", 1)
            s = Shape.of(mcfg, r["seq_len"], cp, r.get("world", cp), 1, param_bytes=4 if fp32 else 2,
                         attn_backend=backend)
            lv = Levers(r.get("offload_layers", s.layers),
                        r.get("keep_attention_layers", 0 if "keep_attention false" in extra else s.layers))
            name = (f"{r['model']} {r['seq_len']} cp{cp}{' dp' + str(s.world // cp) if s.world > cp else ''} "
                    f"{'fp32' if fp32 else 'bf16'} {backend} off {lv.offload_layers} keep {lv.keep_attention_layers}")
            runs.append((s, lv, r["s_per_step"], r["peak_mem_gib"], name))
    return runs


def solve(runs) -> dict:
    """The constants that fit `runs` best: relative least squares, time and memory apart."""
    import numpy as np
    backends = sorted({s.attn_backend for s, *_ in runs})
    A, B, z = [], [], []
    for s, lv, t, mem, _ in runs:
        L, T = s.layers, s.tokens
        attn = 2 * s.seq_len ** 2 * s.heads * s.head_dim * L / s.cp * (3.5 + (L - lv.keep_attention_layers) / L)
        gemm = 8 * L * s.block_params * T + 6 * s.hidden * s.vocab * T
        A.append(np.array([attn / 1e12 * (b == s.attn_backend) for b in backends] + [gemm / 1e12, L * T / 1e6]) / t)
        per_constant = np.array([T * s.hidden, T * s.heads * s.head_dim * (s.cp > 1)])
        known = gpu_bytes(s, lv) - per_constant @ [WORK_BYTES_PER_TOKEN_HIDDEN, RING_BYTES_PER_TOKEN_QDIM]
        B.append(per_constant / (mem * 2**30))
        z.append(1 - known / (mem * 2**30))
    x = np.linalg.lstsq(np.array(A), np.ones(len(A)), rcond=None)[0]
    w = np.linalg.lstsq(np.array(B), np.array(z), rcond=None)[0]
    return dict(ATTN_TFLOPS={**ATTN_TFLOPS, **{b: round(1 / float(x[i]), 1) for i, b in enumerate(backends)}},
                GEMM_TFLOPS=round(1 / float(x[-2]), 1), OTHER_S_PER_MTOKEN_LAYER=round(float(x[-1]), 3),
                WORK_BYTES_PER_TOKEN_HIDDEN=round(float(w[0]), 1), RING_BYTES_PER_TOKEN_QDIM=round(float(w[1]), 2))


def errors_with(constants: dict, runs):
    """errors(runs) as if `constants` were the ones at the top of this file."""
    saved = {name: globals()[name] for name in constants}
    globals().update(constants)
    try:
        return errors(runs)
    finally:
        globals().update(saved)


def fit():
    """Fit the constants to FIT_FILES; print them (copy them above to keep them) and each run's error."""
    runs = measured_runs(FIT_FILES)
    fitted = solve(runs)
    for name, value in fitted.items():
        print(f"{name} = {value}")
    return errors_with(fitted, runs)


def check():
    """Errors out of sample: each run of FIT_FILES predicted by the constants fitted to all the others (leave one
    out), then the runs of CHECK_FILES, which no fit has seen, by the constants above."""
    runs = measured_runs(FIT_FILES)
    out = [errors_with(solve(runs[:i] + runs[i + 1:]), [run])[0] for i, run in enumerate(runs)]
    return out + [(name + " *", dt, dm) for name, dt, dm in errors(measured_runs(CHECK_FILES))]


def errors(runs):
    """[(run, relative time error, relative GPU memory error)] with the constants above."""
    out = []
    for s, lv, t, mem, name in runs:
        c = predict(s, lv)
        out.append((name, c.step_s / t - 1, c.gpu_gib / mem - 1))
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true", help="re-fit the constants to FIT_FILES, print the errors")
    ap.add_argument("--check", action="store_true", help="out-of-sample errors: leave-one-out and CHECK_FILES")
    ap.add_argument("--model", default="bench/configs/qwen3-8b")
    ap.add_argument("--seq_len", type=int, default=1_048_576)
    ap.add_argument("--nproc", type=int, default=8, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--cp", type=int, default=0, help="0: all GPUs")
    ap.add_argument("--param_dtype", default="float32")
    ap.add_argument("--attn_backend", default="cudnn", choices=sorted(ATTN_TFLOPS), help="the kernels timed")
    ap.add_argument("--gpu_mem_gib", type=float, default=74.5, help="per GPU (80 GB = 74.5 GiB)")
    ap.add_argument("--host_mem_gib", type=float, default=1907, help="per node (2 TB = 1907 GiB)")
    a = ap.parse_args()
    if a.fit or a.check:
        if a.check:
            print("each run predicted by constants fitted without it; * = a run outside the fit")
        for name, dt, dm in fit() if a.fit else check():
            print(f"{name:<52} time {dt:+6.1%}   GPU memory {dm:+6.1%}")
    else:
        world = a.nproc * a.nodes
        s = Shape.of(M.Qwen3Config.from_pretrained(a.model), a.seq_len, a.cp or world, world, a.nproc,
                     param_bytes=4 if a.param_dtype == "float32" else 2, attn_backend=a.attn_backend)
        try:
            lv, c = choose(s, a.gpu_mem_gib, a.host_mem_gib)
            print(describe(lv, c, s))
        except NoFit as e:
            raise SystemExit(f"error: {e}")
