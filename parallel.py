"""Context parallelism (zigzag ring attention) and FSDP2 sharding, as plain functions.

Process groups and meshes are passed in as arguments; nothing here holds training state.

    python -m pytest tests/test_ring.py -q      # the ring against naive attention, 1/2/4 ranks under gloo
    python -m pytest tests/test_docs.py -q      # the ring within documents (doc_lens), likewise
    python bench/ring_sim.py                    # the CUDA kernels in a simulated ring of 8 (one GPU)
"""
import bisect
import functools
import itertools
import operator
import warnings

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# Zigzag sharding
# ---------------------------------------------------------------------------------------------

# Causal attention over one long sequence split across the ranks of a context-parallel group. The sequence
# is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r (zigzag): one early and one late chunk, so
# every rank owns the same share of the causal triangle.


def zigzag_shard(x, dim, rank, world):
    """Rank's zigzag shard of x along dim: chunks rank and 2*world-1-rank of 2*world equal chunks."""
    if x.shape[dim] % (2 * world):
        raise ValueError(f"sequence length L={x.shape[dim]} must be divisible by 2*cp={2 * world}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(shards, dim):
    """Inverse of zigzag_shard, from the list of all ranks' shards in rank order."""
    halves = [s.chunk(2, dim) for s in shards]  # rank r: (chunk r, chunk 2w-1-r)
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def zigzag_positions(seq_len, rank, world, device=None):
    """Global position ids [seq_len // world] of rank's tokens (its RoPE positions)."""
    return zigzag_shard(torch.arange(seq_len, device=device), 0, rank, world)


# ---------------------------------------------------------------------------------------------
# The attention kernels
# ---------------------------------------------------------------------------------------------

# Kernels that return each query row's log-sum-exp (the ring merges with it) and take GQA and the model's
# [B, T, H, D] memory seen as [B, H, T, D] as they are: a .contiguous() here copied q, k, v and dout in every layer.
# Chosen once (resolve_backend): fa4 (FlashAttention-4, sm90+: the fastest; compiles each variant on first call;
# gradients not bit-reproducible: bench/results/fa4_attn.json), cudnn (the fastest in PyTorch), flash
# (FlashAttention-2, where cuDNN refuses an input: ~1.7x cuDNN's time, bench/results/flash_attn.json), cpu (CPU
# tensors, whatever the backend: the whole ring runs under gloo in CI).
ATTN_BACKENDS = ("auto", "fa4", "cudnn", "flash")
_warned = set()


def _warn_once(key, msg):
    """One warning per key, not one per layer and step."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


@functools.cache
def fa4_unavailable():
    """Why FlashAttention-4 cannot run here, or None when it can. Imported only here and in _fa4_*: CI has no
    GPU and no flash-attn-4, and importing the CuTe DSL costs a few seconds."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"it needs an sm90 (Hopper) or newer GPU, this one is sm{major}{minor}"
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as e:  # ImportError, or the DSL failing to load its libraries
        return f"flash_attn.cute does not import ({type(e).__name__}: {str(e)[:200]})"
    return None


def resolve_backend(backend="auto"):
    """The attention kernels that `backend` (one of ATTN_BACKENDS) means on this machine: "fa4", "cudnn" or
    "flash", or "cpu" where CUDA is unavailable. "auto" takes fa4 where it imports and the GPU is sm90 or newer,
    else cudnn (which falls back to flash where it refuses an input)."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: want one of {', '.join(ATTN_BACKENDS)}")
    if backend == "fa4" and fa4_unavailable():
        raise ValueError(f"attention backend fa4: {fa4_unavailable()}; install it with `pip install flash-attn-4` "
                         "(sm90+ GPUs) or pass --attn_backend cudnn")
    if not torch.cuda.is_available():
        return "cpu"
    if backend == "auto":
        return "cudnn" if fa4_unavailable() else "fa4"
    return backend


# cuDNN's attention kills the process (a segfault, no error to catch) in backward on a piece of a few tokens, as
# a document mask makes (a one-token document; a document's last token in a chunk): bench/results/short_pieces.json.
# Such pieces run on flash attention, whose cost there is nil.
CUDNN_MIN_TOKENS = 16


def _kernels(backend, device, q=None, k=None):
    """The kernels for tensors on `device`: the CPU op for CPU tensors, whatever the backend; flash for the short
    pieces cuDNN cannot run."""
    if device.type == "cpu":
        return "cpu"
    kernels = resolve_backend("auto" if backend == "cpu" else backend)
    if kernels == "cudnn" and q is not None and min(q.shape[2], k.shape[2]) < CUDNN_MIN_TOKENS:
        return "flash"
    return kernels


def _cudnn_refused(e):
    """cuDNN declines inputs it has no plan for with a RuntimeError that names it; those run on flash. Anything
    else (out of memory above all: a retry on another kernel would hide it) is not a refusal."""
    return not isinstance(e, torch.OutOfMemoryError) and "cudnn" in str(e).lower()


def _fa4_fwd(q, k, v, causal):
    from flash_attn.cute.interface import _flash_attn_fwd
    out, lse = _flash_attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                               return_lse=True)[:2]  # out [B, Tq, Hq, D]; lse [B, Hq, Tq] fp32, natural log
    return out.transpose(1, 2), lse


def _fa4_bwd(dout, q, k, v, out, lse, causal):
    from flash_attn.cute.interface import _flash_attn_bwd
    dq, dk, dv = _flash_attn_bwd(*(x.transpose(1, 2) for x in (q, k, v, out, dout)), lse, causal=causal)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _attn_fwd(q, k, v, causal, backend="auto"):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> out [B, Hq, Tq, D] in q.dtype, lse [B, Hq, Tq] fp32 (natural log).
    causal is used only with Tq == Tk (where cuDNN's top-left and FlashAttention's bottom-right masks agree):
    query i sees keys 0..i."""
    kernels = _kernels(backend, q.device, q, k)
    if kernels == "cpu":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    if kernels == "fa4":
        return _fa4_fwd(q, k, v, causal)
    if kernels == "cudnn":
        try:
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
            return out, lse.reshape(out.shape[:3])  # cuDNN's lse is [B, Hq, Tq, 1]
        except RuntimeError as e:
            if not _cudnn_refused(e):
                raise
            _warn_once("forward", f"cuDNN attention refused an input in forward ({str(e)[:200]}); such "
                       "inputs run on flash attention, slower")
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]


# The backward's workspace grows with heads x length and was the largest item at the step's memory peak; heads are
# independent, so it runs a few at a time (cuDNN at 131k: 5.5 -> 2.4 GiB, same time: bench/results/attn_heads.json).
BWD_QUERY_HEADS_PER_CALL = 4


def _attn_bwd_call(dout, q, k, v, out, lse, causal, kernels):
    if kernels == "cpu":
        dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if kernels == "fa4":
        return _fa4_bwd(dout, q, k, v, out, lse, causal)
    tq, tk, lse = q.shape[2], k.shape[2], lse.contiguous()
    rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout seed/offset: unused at p = 0
    if kernels == "cudnn":
        try:
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse.unsqueeze(-1), rng, rng, None, None, None, tq, tk, 0.0, causal)
        except RuntimeError as e:
            if not _cudnn_refused(e):
                raise
            _warn_once("backward", f"cuDNN attention refused an input in backward ({str(e)[:200]}); such "
                       "inputs run on flash attention, slower")
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, tq, tk, 0.0, causal, rng, rng)


def _attn_bwd(dout, q, k, v, out, lse, causal, heads_per_call=None, backend="auto"):
    """Gradients of one _attn_fwd call from its inputs, out (in q.dtype) and lse [B, Hq, Tq] fp32.
    -> dq [B, Hq, Tq, D], dk/dv [B, Hkv, Tk, D], in q.dtype. Runs heads_per_call query heads (with their
    K/V heads) per kernel call (default BWD_QUERY_HEADS_PER_CALL, rounded to whole K/V heads dividing Hkv)."""
    kernels = _kernels(backend, q.device, q, k)
    hq, hkv = q.shape[1], k.shape[1]
    per_kv = hq // hkv  # query heads per K/V head
    kv_step = max(1, min(hkv, (heads_per_call or BWD_QUERY_HEADS_PER_CALL) // per_kv))
    while hkv % kv_step:
        kv_step -= 1
    if kv_step == hkv:
        return _attn_bwd_call(dout, q, k, v, out, lse, causal, kernels)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # q's memory layout
    for h in range(0, hkv, kv_step):
        kh, qh = slice(h, h + kv_step), slice(h * per_kv, (h + kv_step) * per_kv)
        grads = _attn_bwd_call(dout[:, qh], q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh], causal, kernels)
        for whole, part, heads in zip((dq, dk, dv), grads, (qh, kh, kh)):
            whole[:, heads].copy_(part)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------

# Ring attention passes the K/V shards (the KV heads only) round the ranks while each rank attends to them,
# and merges the partial results with their log-sum-exp. Layout after zhuzilin/ring-flash-attention's zigzag
# variant: a forward, a backward and a thin autograd.Function that only saves tensors. Tested in
# tests/test_ring.py (CPU, gloo) and tests/test_fa4.py (GPU, NCCL); bench/ring_sim.py times the CUDA kernels.

def _visible_part(rank, src, t):
    """The part of the causal mask between this rank's queries and source rank src's keys at one ring step:
    (query rows, key columns, causal), both halves of length t // 2. With the local pair [A | B] =
    chunks [rank | 2w-1-rank] and the source pair [C | D] = chunks [src | 2w-1-src]:
      src == rank: the local pair against itself, causal (A comes before B, so the mask on the pair is exact);
      src <  rank: C comes before A and B, D after both: every local query sees C, none sees D;
      src >  rank: C and D come after A and before B: only B sees the source, all of it.
    Each case is t*t/2 query-key pairs, so every rank does the same work at every step."""
    h = t // 2
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, h), False
    return slice(h, None), slice(None), False


# Documents. A window may hold several documents laid end to end (doc_lens: their lengths, in order, summing to
# the global length); a query then sees only the keys of its own document, up to itself. Each (query chunk, key
# chunk) pair of a ring step is intersected with the documents, and only what is left is launched.

@functools.lru_cache(maxsize=8)  # a window's blocks serve every layer, forward and backward
def _doc_blocks(doc_lens, rank, world):
    """Per ring step i (source rank - i), a tuple of this rank's (query rows, key columns, causal) blocks of the
    document mask, in local coordinates (the source's for the columns). doc_lens: a tuple of 2+ positive ints.

    With the local chunks [A | B] and the source's [C | D] (zigzag; a ring of one has a single chunk, the whole
    window), each pair of a query chunk and a key chunk not after it gives:
      the same chunk: one causal block per document piece inside it (the diagonal);
      key chunk before query chunk: a document is contiguous, so only the one holding the key chunk's last token
        can reach the query chunk. If it does, one full block: its queries in the query chunk x its keys in the
        key chunk. Otherwise nothing: a pair sharing no document launches no kernel.
    Invariants (tests/test_docs.py): the blocks of all ranks and steps cover the document mask exactly once; the
    causal blocks are all at step 0, come first, and cover each local row once (every query sees itself), so
    each row is written by its causal block before any other block is merged into it. One kernel call per block:
    correct, but slow for many short documents, and the ranks' work is not balanced (zigzag balances the one
    full triangle only)."""
    t = sum(doc_lens)
    ends = list(itertools.accumulate(doc_lens))  # document j covers [ends[j] - doc_lens[j], ends[j])
    n = 1 if world == 1 else 2 * world
    c = t // n

    def chunks(r):  # (global start, local start) of rank r's chunks
        return ((0, 0),) if world == 1 else ((r * c, 0), ((n - 1 - r) * c, c))

    steps = []
    for i in range(world):
        diagonal, full = [], []
        for q0, row0 in chunks(rank):
            for k0, col0 in chunks((rank - i) % world):
                if k0 == q0:
                    j = bisect.bisect_right(ends, q0)  # the document holding the chunk's first token
                    while j < len(ends) and ends[j] - doc_lens[j] < q0 + c:
                        lo, hi = max(ends[j] - doc_lens[j], q0), min(ends[j], q0 + c)
                        piece = slice(lo - q0 + row0, hi - q0 + row0)  # step 0: the source is this rank
                        diagonal.append((piece, piece, True))
                        j += 1
                elif k0 < q0:
                    j = bisect.bisect_right(ends, k0 + c - 1)  # the document holding the key chunk's last token
                    if ends[j] > q0:
                        rows = slice(row0, min(ends[j], q0 + c) - q0 + row0)
                        cols = slice(max(ends[j] - doc_lens[j], k0) - k0 + col0, c + col0)
                        full.append((rows, cols, False))
        steps.append(tuple(diagonal + full))
    return tuple(steps)


def _ring_blocks(doc_lens, rank, world, t):
    """Per ring step, the blocks to compute: _visible_part's one block without documents, else _doc_blocks."""
    if doc_lens is None:
        return tuple((_visible_part(rank, (rank - i) % world, t),) for i in range(world))
    return _doc_blocks(doc_lens, rank, world)


def _acc(q):
    """The merge's and the gradient accumulators' dtype: fp32, or float64 for float64 inputs (the CPU tests)."""
    return torch.promote_types(q.dtype, torch.float32)


def _fwd_block(q, k, v, out, lse, block, backend="auto"):
    """Attend the local q [B, Hq, T, D] to one block (rows, cols, causal) of a source's k/v [B, Hkv, T, D] and
    fold the result into the running out [B, Hq, T, D] / lse [B, Hq, T] (_acc: fp32, or float64 for float64
    inputs; None before the one sequence's step 0). With documents, a causal block is the first to reach its rows
    (_doc_blocks): it is written, not merged, so no row is merged before it holds a finite lse."""
    rows, cols, causal = block
    out_b, lse_b = _attn_fwd(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, backend)
    if out is None:  # step 0 covers every row
        return out_b.to(_acc(q)), lse_b.to(_acc(q))
    o, l = out[:, :, rows], lse[:, :, rows]  # views: updated in place
    if causal:  # documents only: the first block to reach these rows
        o.copy_(out_b)
        l.copy_(lse_b)
        return out, lse
    # softmax over the union of both key sets, in fp32; lerp(o, out_b, w) = o - w*(o - out_b)
    o.lerp_(out_b.to(o.dtype), torch.sigmoid(lse_b - l).unsqueeze(-1))
    l.sub_(torch.nn.functional.logsigmoid(l - lse_b))  # = log(exp(l) + exp(lse_b))
    return out, lse


def _bwd_block(dout, q, k, v, out, lse, dq, block, backend="auto"):
    """The backward of one block (rows, cols, causal), with the final out (q.dtype) and lse: adds the block's
    dQ into dq [B, Hq, T, D] (_acc) and returns (cols, dk_b, dv_b), the gradient of the source's K/V columns."""
    rows, cols, causal = block
    dq_b, dk_b, dv_b = _attn_bwd(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                 out[:, :, rows], lse[:, :, rows], causal, backend=backend)
    dq[:, :, rows] += dq_b
    return cols, dk_b, dv_b


class _Ring:
    """Sends tensors to the next rank of the group and receives the same shapes from the previous one.
    start() posts the transfer and returns the receive buffers at once; wait() before reading them, so
    the transfer runs while the caller computes (a double buffer: the current K/V and the next)."""

    def __init__(self, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)
        self.group, self.reqs = group, []

    def start(self, *tensors):
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        self.reqs = dist.batch_isend_irecv(ops)
        return bufs

    def wait(self):
        for req in self.reqs:
            req.wait()
        self.reqs = []


def _ring_fwd(q, k, v, group, backend, doc_lens=None):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], zigzag-sharded over group -> out [B, Hq, T, D] in q.dtype,
    lse [B, Hq, T] fp32. At step i this rank holds the K/V of rank - i. doc_lens: None (one sequence) or a
    tuple of 2+ document lengths over the whole window (_documents)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1 and doc_lens is None:  # one device: the kernel's own output, no fp32 merge buffer
        return _attn_fwd(q, k, v, True, backend)
    steps = _ring_blocks(doc_lens, rank, world, q.shape[2])
    out = lse = None
    if doc_lens is not None:  # blocks reach some rows only: buffers, each row first written by a causal block
        out, lse = torch.empty_like(q, dtype=_acc(q)), q.new_empty(q.shape[:3], dtype=_acc(q))
    if world > 1:
        k, v = k.contiguous(), v.contiguous()  # they are sent, and NCCL/gloo send contiguous tensors only
    ring = _Ring(group)
    for i in range(world):
        if i + 1 < world:
            k_next, v_next = ring.start(k, v)
        for block in steps[i]:
            out, lse = _fwd_block(q, k, v, out, lse, block, backend)
        if i + 1 < world:
            ring.wait()
            k, v = k_next, v_next
    return out.to(q.dtype), lse  # the backward kernels take out in q's dtype


def _ring_bwd(dout, q, k, v, out, lse, group, backend, doc_lens=None):
    """dout, q, out [B, Hq, T, D], k/v [B, Hkv, T, D], lse [B, Hq, T] fp32 -> dq, dk, dv in the inputs' dtype.
    K/V go round the ring again; dK/dV buffers (fp32) go round with them, one step behind: the buffer a
    rank holds at step i belongs to the K/V it holds, rank - i. After the last step it belongs to rank + 1,
    so one more hop delivers every buffer, with all world contributions, to its owner. doc_lens: as in forward,
    which gives the same blocks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1 and doc_lens is None:  # one device: the kernel's own gradients, no fp32 accumulators
        return _attn_bwd(dout, q, k, v, out, lse, True, backend=backend)
    steps = _ring_blocks(doc_lens, rank, world, q.shape[2])
    dtypes = q.dtype, k.dtype, v.dtype
    if world > 1:
        k, v = k.contiguous(), v.contiguous()
    kv_ring, grad_ring = _Ring(group), _Ring(group)
    dq = torch.zeros_like(q, dtype=_acc(q))
    dk = torch.zeros_like(k, dtype=_acc(q))
    dv = torch.zeros_like(v, dtype=_acc(q))
    for i in range(world):
        if i + 1 < world:
            k_next, v_next = kv_ring.start(k, v)
        grads = [_bwd_block(dout, q, k, v, out, lse, dq, block, backend) for block in steps[i]]
        if i > 0:  # the source's buffer, sent on by the previous rank after its step i - 1
            grad_ring.wait()
            dk, dv = dk_next, dv_next
        for cols, dk_b, dv_b in grads:
            dk[:, :, cols] += dk_b
            dv[:, :, cols] += dv_b
        if world > 1:  # a ring of one keeps its buffers
            dk_next, dv_next = grad_ring.start(dk, dv)
        if i + 1 < world:
            kv_ring.wait()
            k, v = k_next, v_next
    if world > 1:
        grad_ring.wait()
        dk, dv = dk_next, dv_next
    return tuple(g.to(dt) for g, dt in zip((dq, dk, dv), dtypes))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, backend, doc_lens):
        out, lse = _ring_fwd(q, k, v, group, backend, doc_lens)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.backend, ctx.doc_lens = group, backend, doc_lens
        return out

    @staticmethod
    def backward(ctx, dout):
        return *_ring_bwd(dout, *ctx.saved_tensors, ctx.group, ctx.backend, ctx.doc_lens), None, None, None


def _check(q, k, v, group):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"want q [B, Hq, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    (b, hq, t, d), (bk, hkv, tk, dk) = q.shape, k.shape
    if (b, t, d) != (bk, tk, dk):
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, length or head_dim")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if t % 2 and not (dist.is_initialized() and dist.get_world_size(group) == 1):  # a ring of one: any T
        raise ValueError(f"local length T={t} must be even: a rank holds two equal zigzag chunks")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k and v must share dtype and device")
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the CUDA attention kernels take bf16 or fp16, not {q.dtype}")


def _documents(doc_lens, t, group):
    """doc_lens (document lengths over the whole window, in order) checked against the local length t on each
    rank of group -> a tuple of ints (the key of _doc_blocks' cache), or None for one document: the plain ring."""
    if doc_lens is None:
        return None
    world = dist.get_world_size(group)
    try:
        lens = tuple(operator.index(n) for n in doc_lens)
    except TypeError:
        raise ValueError(f"doc_lens must be a sequence of ints (document lengths); got {doc_lens!r:.200}") from None
    if not lens or min(lens) < 1 or sum(lens) != t * world:
        raise ValueError(f"doc_lens must be positive lengths summing to the window's {t * world} tokens ({t} on "
                         f"each of {world} ranks); got {len(lens)} lengths, sum {sum(lens)}, "
                         f"min {min(lens, default=0)}")
    return lens if len(lens) > 1 else None


class RingAttention:
    """The model's attn_fn: causal attention over a sequence zigzag-sharded (zigzag_shard, with the rank in
    `group`) across the ranks of `group`; a group of one is plain causal attention. q [B, Hq, T, D],
    k/v [B, Hkv, T, D] with Hkv dividing Hq, T this rank's two chunks; softmax scale 1/sqrt(D).

    doc_lens: the window's documents, their lengths in order over the whole (global, unsharded) window, the same
    in every batch row; a query then sees only keys of its own document, up to itself. None or one length: one
    causal sequence. The RoPE positions inside each document are the caller's (the model's position_ids).

    backend: one of ATTN_BACKENDS, resolved once here; self.backend says which kernels run ("fa4", "cudnn",
    "flash", or "cpu" without CUDA). Calling it is differentiable; fwd and bwd are its two halves without
    autograd, for the recomputed block that keeps attention's output and lse (model.py, "Memory levers")."""

    def __init__(self, group, backend="auto"):
        self.group, self.backend = group, resolve_backend(backend)

    def __call__(self, q, k, v, doc_lens=None):
        """-> out [B, Hq, T, D] in q.dtype."""
        _check(q, k, v, self.group)
        doc_lens = _documents(doc_lens, q.shape[2], self.group)
        return _RingAttention.apply(q, k, v, self.group, self.backend, doc_lens)

    def fwd(self, q, k, v, doc_lens=None):
        """-> out [B, Hq, T, D] in q.dtype, lse [B, Hq, T] fp32."""
        _check(q, k, v, self.group)
        return _ring_fwd(q, k, v, self.group, self.backend, _documents(doc_lens, q.shape[2], self.group))

    def bwd(self, dout, q, k, v, out, lse, doc_lens=None):
        """-> dq, dk, dv in the inputs' dtype. doc_lens: the forward's."""
        return _ring_bwd(dout, q, k, v, out, lse, self.group, self.backend,
                         _documents(doc_lens, q.shape[2], self.group))


def ring_attention(q, k, v, group, backend="auto", doc_lens=None):
    """Causal ring attention of q [B, Hq, T, D] to k/v [B, Hkv, T, D] over `group` (see RingAttention), within
    documents when doc_lens is given. -> [B, Hq, T, D] in q.dtype. Differentiable w.r.t. q, k, v."""
    return RingAttention(group, backend)(q, k, v, doc_lens)


# ---------------------------------------------------------------------------------------------
# FSDP2 and gradient clipping
# ---------------------------------------------------------------------------------------------

def shard_model(model, mesh, param_dtype, reduce_dtype=torch.float32):
    """FSDP2 over every rank of `mesh`: each block is its own unit, then the root (embedding, final norm, head).

    The root is not resharded after forward: it owns the head weight used by the loss at the end of forward
    and, when tied, the embedding used at the start, so it stays gathered until its backward has run.
    Gradients are summed, not averaged, over ranks: the loss is already divided by the global token count,
    and ranks of one context-parallel group hold different parts of the same sequence."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for m in (*model.layers, model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM, and 1.0 needs none
    return model


def local_shard(t):
    """This rank's part of a DTensor (an FSDP2 parameter or gradient); a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t




@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip the global gradient norm of FSDP-sharded parameters; returns the norm before clipping (fp32).

    Each rank holds disjoint shards, so the squared norms of the local shards sum to the global one."""
    grads = [local_shard(p.grad) for p in params if p.grad is not None]
    sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


# ---------------------------------------------------------------------------------------------
# Ranks agreeing
# ---------------------------------------------------------------------------------------------

def agree(flags: list[bool], device, group=None) -> list[bool]:
    """One collective: each flag is true on every rank if it is true on any."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in t.tolist()]


def all_ok(error: str | None, what: str, device, exc=SystemExit):
    """A collective check that every rank succeeded at `what` (error None): if one did not, every rank raises
    exc together, the failing one with its own message, the others pointing to it."""
    if agree([error is not None], device)[0]:
        raise exc(error or f"error: {what} failed on another rank (see its message); stopping")
