"""Gated DeltaNet, the linear attention of Qwen3.5 (qwen3_5.py): the chunked gated delta rule in pure torch, and the
sequence mixing of a DeltaNet layer (its causal depthwise conv and the recurrence) on one device or over the ranks of
a context-parallel group, for one sequence or a window of packed documents.

Under context parallelism the state is carried across ranks with span summaries (DESIGN.md, "Qwen3.5"): over a span
the state after is linear in the state before, S_out = M S_in + R (transformers' layout: S is [dk, dv], so M
[dk, dk] multiplies from the left). Each rank summarises its chunks, the summaries are all-gathered, and a scan in
sequence order gives every chunk the state it starts from. Measured on an H200, the summaries cost 29 ms a layer-step
at a rank's 131,072 tokens, less than the traffic of an all-to-all to head-parallel, Megatron-LM's way
(bench/NOTES.md, "Span summaries or an all-to-all").

    python -m pytest tests/test_qwen3_5.py -q
"""
import bisect
import contextlib
import functools
import itertools
import math
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import zigzag_layout

CHUNK = 64  # tokens per chunk of the chunked rule, as fla and transformers
KERNELS = ("auto", "fla", "torch")  # --deltanet_kernel


@functools.cache
def fla_unavailable():
    """Why fla's chunked kernels (fla-core 0.6, Triton) cannot run here, or None when they can. Imported only
    here: CI has no GPU and no fla."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # ImportError, or Triton failing to load
        return f"fla does not import ({type(e).__name__}: {str(e)[:200]})"
    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:3])
    if torch.cuda.get_device_capability()[0] == 9 and version < (3, 7, 1):  # fla refuses it in the backward
        return f"Triton {triton.__version__} computes fla's gated backward wrongly on Hopper; it needs >= 3.7.1"
    return None


def resolve_kernel(kernel="auto"):
    """What --deltanet_kernel means here: "fla" (GPU kernels) or "torch" (chunk_gated_delta_rule below, which
    also runs on the CPU and is the oracle the fla path is tested against). auto: fla where it can run."""
    if kernel not in KERNELS:
        raise ValueError(f"--deltanet_kernel {kernel}: use one of {', '.join(KERNELS)}")
    if kernel == "fla" and not torch.cuda.is_available():
        raise ValueError("--deltanet_kernel fla needs a CUDA GPU (fla's kernels are Triton's): pass --deltanet_kernel "
                         "torch or auto")
    if kernel == "fla" and fla_unavailable():
        raise ValueError(f"--deltanet_kernel fla: {fla_unavailable()}; install it with `pip install fla-core "
                         "triton>=3.7.1` (bench/gpu_wheels.sh without a package index) or pass --deltanet_kernel torch")
    return ("torch" if fla_unavailable() else "fla") if kernel == "auto" else kernel


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's and transformers' form (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, chunk=CHUNK, final=True):
    """The gated delta rule over one span, S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T and
    o_t = S_t^T q_t, computed a chunk at a time (the form of fla and of transformers' torch_chunk_gated_delta_rule).

    q, k [B, H, T, dk] (L2-normalised, q scaled by dk^-1/2), v [B, H, T, dv], g (log decay, <= 0) and beta
    [B, H, T], all in one float dtype (fp32 or wider: the rule is not run in bf16); state [B, H, dk, dv] before the
    span, None for zeros. -> (o [B, H, T, dv], state after the span [B, H, dk, dv]; computed whatever final says,
    the flag that lets fla skip it).

    The oracle of the GPU kernel: torch_rule (below) calls it as a layer does, fla_rule runs fla's kernels."""
    B, H, T, _ = k.shape
    pad = -T % chunk  # padded tokens have beta 0 (write nothing) and g 0 (keep the state): the state passes through
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))                      # [B, H, n, C, d]
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)                 # [B, H, n, C]
    cum = g.cumsum(-1)                                    # log decay from the chunk's start to each token
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()  # [B, H, n, C, C]
    kb = k * beta[..., None]
    # The chunk's C rank-one updates at once (the WY/UT transform): with L the strictly lower part of
    # (beta k k^T) * decay, u = (I + L)^-1 (beta v) are the values written and w = (I + L)^-1 (beta k decayed) the
    # keys through which the state before the chunk is read and corrected (the delta rule's "v - S^T k").
    system = (kb @ k.transpose(-1, -2)) * decay                                       # [B, H, n, C, C]
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)  # [.., C, dv]
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay              # within the chunk, token i reading token j <= i
    q_in = q * cum.exp()[..., None]                       # q reading the state from before the chunk
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]    # k decayed to the chunk's end, writing the next state
    last = cum[..., -1].exp()[..., None, None]            # [B, H, n, 1, 1] decay over the whole chunk
    S = state if state is not None else q.new_zeros(B, H, k.shape[-1], v.shape[-1])
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S                                           # [B, H, C, dv]
        out.append(q_in[:, :, i] @ S + attn[:, :, i] @ v_new)
        S = S * last[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ v_new              # [B, H, dk, dv]
    return torch.stack(out, 2).reshape(B, H, n * chunk, -1)[:, :, :T], S


def torch_rule(q, k, v, g, beta, state=None, final=True):
    """The rule as a DeltaNet layer calls it, on one span. q, k [B, T, nk, dk] as the conv gives them (before their
    L2 norm), v [B, T, nv, dv], g (log decay, fp32 or wider) and beta [B, T, nv], state [B, nv, dk, dv] (None: zeros)
    -> (o [B, T, nv, dv], the state after the span). Key head h serves value heads h * nv/nk to (h + 1) * nv/nk - 1.
    Here: q and k normalised in fp32 (or wider), q scaled by dk^-1/2, repeated to the value heads, and
    chunk_gated_delta_rule in fp32 or wider; fla_rule computes the same on fla's kernels."""
    wide = torch.promote_types(v.dtype, torch.float32)

    def per_value_head(t, scale=1.0):  # [B, T, nk, dk] -> [B, nv, T, dk], normalised
        return (l2norm(t.to(wide)) * scale).repeat_interleave(v.shape[2] // t.shape[2], 2).transpose(1, 2)

    q, k = per_value_head(q, q.shape[-1] ** -0.5), per_value_head(k)
    o, state = chunk_gated_delta_rule(q, k, *(t.transpose(1, 2).to(wide) for t in (v, g, beta)), state)
    return o.transpose(1, 2), state


@functools.cache
def _fla_kernel():
    """fla's chunk_gated_delta_rule, with one guard. On Hopper the WY backward kernel of the gated rule autotunes
    over 2 and 4 warps, and Triton miscompiles its ungated twin (same chunk of 64, same [64, 64] gradient) at 4 warps
    on sm_90: wrong dk and dbeta, which fla fixed there by keeping 2 warps. fla 0.6 did not do the same for the
    gated kernel, whose dk, dbeta and dg feed dt_bias and A_log; so it keeps 2 warps here too."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, wy_fast
    tuner = getattr(wy_fast.prepare_wy_repr_bwd_kernel, "fn", None)  # triton.heuristics around the autotuner
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hasattr(tuner, "configs"):
        tuner.configs = [c for c in tuner.configs if c.num_warps == 2] or tuner.configs
    return chunk_gated_delta_rule


def fla_rule(q, k, v, g, beta, state=None, final=True):
    """torch_rule on fla's Triton kernels: the same arguments and results (the state in fp32; None when final is
    False, where the caller drops it), q, k, v and beta in the model's dtype, g in fp32. fla takes the layer's
    [B, T, heads, d] as it lies, normalises q and k in its own kernels (transformers asks it the same), and reads
    each key head for its value heads (no repeated copies)."""
    return _fla_kernel()(q, k, v, g.float(), beta.to(q.dtype), scale=q.shape[-1] ** -0.5,
                         initial_state=None if state is None else state.float(), output_final_state=final,
                         use_qk_l2norm_in_kernel=True)


@contextlib.contextmanager
def local_memory_returned():
    """Around fla's first calls (the start-up check, where its autotuner runs): afterwards, shrink CUDA's
    local-memory reservation back to the stack size it had before. CUDA reserves local memory (register spills,
    the stack) for the largest frame any kernel launched so far needed, times every thread the GPU can hold
    (2,048 on each of an H100's 132 SMs), and keeps it at that mark, outside PyTorch's allocator. fla's autotuner
    launches every candidate config once, heavily spilling ones too; the configs it keeps need far less (at the
    9B's heads on an H100: 6.5 GiB for the trials, 0.3 for the kept; bench/RESULTS.md), and later launches grow
    the reservation again only as far as they need. Setting the stack limit makes the driver reallocate it:
    first to 0, then back to the size before (a call with the size it already has might be taken for a no-op)."""
    if not torch.cuda.is_available():
        yield
        return
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")  # the driver torch runs on; its current context is torch's
    before, limit = ctypes.c_size_t(), 0  # CU_LIMIT_STACK_SIZE
    ok = cuda.cuCtxGetLimit(ctypes.byref(before), limit) == 0
    try:
        yield
    finally:
        torch.cuda.synchronize()
        if not (ok and cuda.cuCtxSetLimit(limit, ctypes.c_size_t(0)) == 0
                and cuda.cuCtxSetLimit(limit, before) == 0):
            import warnings
            warnings.warn("cuCtxSetLimit failed: the local memory fla's autotuner reserved stays held outside "
                          "PyTorch's allocator (6.5 GiB on an H100), which --fit auto does not plan for", stacklevel=3)


def disagreement(rule, key_heads, value_heads, dk, dv, dtype=torch.bfloat16, device="cuda", tol=2e-2, length=300,
                 batch=1):
    """`rule` (fla_rule) against torch_rule in fp32 on the same inputs rounded to dtype, at a model's head counts
    and dims and in both ways the mixer calls it (from zero, the final state dropped; from a state, the final state
    used), forward and backward for random upstream gradients: None if every output and gradient is within tol of
    the torch rule's in norm (bf16 lands near 5e-3), else a line naming the worst. Run once at start-up, so that a
    kernel wrong at some shape, or on some Triton, stops a run instead of training it wrongly. batch: sequences
    side by side (train.py's micro-batches hold one)."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    worst = (0.0, "")
    for from_state in (False, True):
        x = [n(batch, length, key_heads, dk), n(batch, length, key_heads, dk), n(batch, length, value_heads, dv)]
        x = [t.to(dtype) for t in x] + [-0.2 * torch.rand(batch, length, value_heads, generator=gen, device=device),
                                        n(batch, length, value_heads).sigmoid().to(dtype)]
        s0 = n(batch, value_heads, dk, dv) if from_state else None
        mine = [t.detach().float().requires_grad_() for t in x] + [s0]
        theirs = [t.detach().requires_grad_() for t in x] + [None if s0 is None else s0.clone().requires_grad_()]
        if from_state:
            mine[5].requires_grad_()
        want, want_state = torch_rule(*mine)
        got, got_state = rule(*theirs, final=from_state)
        do = n(*want.shape)
        outs = [(want, do, got)] + ([(want_state, n(*want_state.shape), got_state)] if from_state else [])
        torch.autograd.backward([w for w, _, _ in outs], [d for _, d, _ in outs])
        torch.autograd.backward([g for _, _, g in outs], [d.to(g.dtype) for _, d, g in outs])
        pairs = {"o": (got, want), **{f"d{name}": (theirs[i].grad, mine[i].grad)
                                      for i, name in enumerate(("q", "k", "v", "g", "beta"))}}
        if from_state:
            pairs.update(state=(got_state, want_state), dstate=(theirs[5].grad, mine[5].grad))
        worst = max(worst, _worst(pairs, "from a state" if from_state else "from zero"))
    err, where = worst
    if err <= tol:
        return None
    return (f"the DeltaNet kernel differs from the torch rule at {key_heads} key and {value_heads} value heads, dk "
            f"{dk}, dv {dv}: relative error {err:.2g} in {where} (tolerance {tol:g})")


def conv_disagreement(conv, channels, width, dtype=torch.bfloat16, device="cuda", tol=2e-2, length=300):
    """`conv` (causal_conv on fla) against the torch conv in fp32 on the same inputs rounded to dtype, at a model's
    conv channels and width, forward and backward for a random upstream gradient: None if the output and the
    input's and weight's gradients are within tol in norm (bf16: about 2e-3), else a line naming the worst. Run at
    start-up beside disagreement."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, width - 1 + length, channels, generator=gen, device=device).to(dtype)
    w = (torch.randn(channels, 1, width, generator=gen, device=device) * 0.5).to(dtype)
    dy = torch.randn(1, length, channels, generator=gen, device=device)
    mine, theirs = ([t.detach().to(dt).requires_grad_() for t in (x, w)] for dt in (torch.float32, dtype))
    want, got = causal_conv(*mine), conv(*theirs)
    want.backward(dy)
    got.backward(dy.to(got.dtype))
    err, where = _worst({"y": (got, want), "dx": (theirs[0].grad, mine[0].grad), "dw": (theirs[1].grad, mine[1].grad)})
    if err <= tol:
        return None
    return (f"the DeltaNet conv kernel differs from the torch conv at {channels} channels: relative error {err:.2g} "
            f"in {where} (tolerance {tol:g})")


def _worst(pairs, label=""):
    """-> (the largest relative error in norm over pairs {name: (got, want)}, its name): inf for a missing or
    non-finite one."""
    worst = (0.0, "")
    for name, (a, b) in pairs.items():
        err = ((a.double() - b.double()).norm() / b.double().norm()).item() if a is not None else float("inf")
        err = err if math.isfinite(err) else float("inf")  # NaN: as wrong as it gets
        worst = max(worst, (err, f"{name} {label}".strip()))
    return worst


def causal_conv(x, weight, kernel="torch"):
    """Depthwise conv, then SiLU, over x [B, K - 1 + t, C] whose first K - 1 rows are the history -> [B, t, C] in
    weight's dtype; weight [C, 1, K]. kernel "fla": fla's Triton conv with the SiLU inside, on x as it lies
    (F.conv1d wants [B, C, T]: a transposed copy in, another out), its first K - 1 outputs dropped."""
    if kernel == "fla":
        from fla.modules.causal_conv1d import causal_conv1d
        return causal_conv1d(x.to(weight.dtype), weight[:, 0], activation="silu")[0][:, weight.shape[-1] - 1:]
    return F.silu(F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, groups=weight.shape[0])).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Where this rank's tokens lie in the window
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)  # one window's plan serves every layer, forward and backward
def _plan(rank, world, t, doc_lens, layout):
    """-> (chunk length c, all ranks' chunks, this rank's chunks). The window (world * t tokens) is cut into equal
    chunks, layout[r] holding rank r's in increasing order (one chunk of t tokens on one device). Each of this rank's
    chunks is (global index j, local start, doc start d, segments): d is where the document holding the chunk's first
    token begins; segments are the chunk's local (start, stop) spans cut at document starts, so that every segment
    after the first begins a document."""
    total = world * t
    doc_lens = doc_lens or (total,)
    if sum(doc_lens) != total or min(doc_lens) < 1:
        raise ValueError(f"doc_lens must be positive lengths summing to the window's {total} tokens, got {doc_lens}")
    layout = ((0,),) if world == 1 else layout
    c = t // len(layout[rank])
    starts = [0, *itertools.accumulate(doc_lens)][:-1]
    mine = []
    for m, j in enumerate(layout[rank]):
        g0, l0 = j * c, m * c  # global and local start
        d = starts[bisect.bisect_right(starts, g0) - 1]
        cuts = [s - g0 + l0 for s in starts if g0 < s < g0 + c]
        mine.append((j, l0, d, tuple(zip([l0, *cuts], [*cuts, l0 + c]))))
    return c, layout, tuple(mine)


class _AllGather(torch.autograd.Function):
    """x -> [world, *x.shape], every rank's x. Backward: each rank's gradient for the gathered copies is summed over
    the ranks (an all-reduce: gloo has no reduce-scatter, and what passes here is small) and this rank keeps its
    own slice. Every rank must use the result, so that every rank runs the backward's collective."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


# ---------------------------------------------------------------------------------------------
# The mixer: a DeltaNet layer's conv and recurrence over this rank's tokens
# ---------------------------------------------------------------------------------------------

class DeltaNetMixer:
    """What a DeltaNet layer needs from outside its tokens, passed to the model as `mixer`: group None (or of one
    rank) is one device; else the context-parallel group whose ranks hold the window's chunks as `layout(world,
    doc_lens)` says (parallel.cp_shard's layouts; None: zigzag; documents.cp_layout for balanced windows of
    documents). The model never touches the group: only this object does.

    Under context parallelism the exchange is exact and differentiable through _AllGather, and autograd runs the rest
    of the backward (the scan's reverse included). Chosen over a hand-written backward for the reverse scan: it is
    short and the same code serves forward and backward; what crosses the ranks is a few [dk, dk + dv] summaries
    and K - 1 tokens per chunk, small next to a chunk's work."""

    def __init__(self, group=None, layout=None, kernel="torch"):
        self.group, self.layout = group, layout
        self.kernel = kernel  # "torch" or "fla" (resolve_kernel's answer)
        self.span_rule = fla_rule if kernel == "fla" else torch_rule  # the rule over one span

    def world(self):
        return 1 if self.group is None else dist.get_world_size(self.group)

    def _where(self, t, doc_lens):
        world = self.world()
        rank = 0 if world == 1 else dist.get_rank(self.group)
        docs = None if doc_lens is None else tuple(int(n) for n in doc_lens)
        layout = None
        if world > 1:
            layout = self.layout(world, docs) if self.layout else zigzag_layout(world)
            layout = tuple(tuple(held) for held in layout)
        return world, _plan(rank, world, t, docs, layout)

    def conv(self, x, weight, doc_lens=None):
        """Causal depthwise conv and SiLU, x [B, T, C] this rank's tokens, weight [C, 1, K] -> [B, T, C]. A token
        sees the K - 1 inputs before it in its document: across a chunk's start they come from
        the chunk before it in the window (another rank's: the halo), at a document's start they are zeros."""
        world, (c, layout, mine) = self._where(x.shape[1], doc_lens)
        K = weight.shape[-1]
        if world > 1:
            if c < K - 1:
                raise ValueError(f"chunks of {c} tokens are shorter than the conv's {K - 1} tokens of history")
            tails = torch.stack([x[:, l0 + c - K + 1:l0 + c] for _, l0, _, _ in mine])  # [n_local, B, K-1, C]
            gathered = _AllGather.apply(tails, self.group)                 # [world, n_local, B, K-1, C]
            tail_of = {j: gathered[r, m] for r, held in enumerate(layout) for m, j in enumerate(held)}
        out = []
        for j, l0, d, segments in mine:
            for s0, s1 in segments:
                prefix = x.new_zeros(x.shape[0], K - 1, x.shape[2])               # [B, K-1, C]
                if world > 1 and s0 == l0 and j > 0:  # the halo, kept where it lies in the same document
                    keep = torch.arange(j * c - K + 1, j * c, device=x.device) >= d
                    prefix = tail_of[j - 1] * keep[:, None].to(x.dtype)    # used even if all masked: see _AllGather
                out.append(causal_conv(torch.cat([prefix, x[:, s0:s1]], 1), weight, self.kernel))
        return torch.cat(out, 1).to(x.dtype)

    def rule(self, q, k, v, g, beta, doc_lens=None):
        """The gated delta rule over this rank's tokens: q, k [B, T, nk, dk] (before their L2 norm), v [B, T, H, dv],
        g, beta [B, T, H] (torch_rule's arguments) -> o [B, T, H, dv]. The state starts from zero at each document.

        Under context parallelism, each chunk's first segment runs once with the state columns [0 | I] beside the
        values (v padded with dk zero columns): its output is then [o0 | A] and its final state [R | M], so that
        the output from the true initial state S is o0 + A S (o_t is linear in S), and (M, R) is the summary the
        scan needs. One pass, no second run once S is known."""
        world, (c, layout, mine) = self._where(q.shape[1], doc_lens)
        (B, _, H, dv), dk = v.shape, k.shape[-1]
        out, pending, summaries = [], [], []
        for j, l0, d, segments in mine:
            carried = d < j * c  # the chunk's first token continues a document begun before the chunk
            for s0, s1 in segments:
                part = [x[:, s0:s1] for x in (q, k, v, g, beta)]
                if world == 1 or s0 != l0:  # one device, or a segment that begins a document: from zero
                    o, state = self.span_rule(*part, final=world > 1)  # a summary needs the last state
                    out.append(o)
                    continue
                # every rank's first segments run this way, even from a document's start (then S is multiplied by
                # 0): each rank then uses the gathered summaries, as _AllGather needs
                eye = torch.eye(dk, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
                part[2] = F.pad(part[2], (0, dk))                                 # v -> [v | 0]
                o, state = self.span_rule(*part, F.pad(eye.expand(B, H, dk, dk), (dv, 0)))  # [B, H, dk, dv + dk]
                out.append(o[..., :dv])
                pending.append((len(out) - 1, j, o[..., dv:], carried))          # A [B, len, H, dk]
                M = state[..., dv:]
            if world > 1:  # the chunk's summary [R | M]; past a document start in the chunk, S_in reaches nothing
                M = M if carried and len(segments) == 1 else torch.zeros_like(M)
                summaries.append(torch.cat([state[..., :dv], M], -1))
        if world == 1:
            return torch.cat(out, 1)
        gathered = _AllGather.apply(torch.stack(summaries), self.group)          # [world, n_local, B, H, dk, dv+dk]
        summary = {j: gathered[r, m] for r, held in enumerate(layout) for m, j in enumerate(held)}
        S, start = gathered.new_zeros(B, H, dk, dv), []  # in the state's dtype (fp32 at least)
        for j in range(len(summary)):  # the scan, in sequence order: S_out = M S_in + R
            start.append(S)
            S = summary[j][..., dv:] @ S + summary[j][..., :dv]
        for i, j, A, carried in pending:
            out[i] = out[i] + torch.einsum("bthk,bhkv->bthv", A.to(S.dtype), start[j] * float(carried)).to(out[i].dtype)
        return torch.cat(out, 1)
