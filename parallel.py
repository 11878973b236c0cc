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
# Sharding the window over the ranks of a context-parallel group
# ---------------------------------------------------------------------------------------------

# The window is cut into n equal chunks and each rank holds n / cp of them, end to end in increasing order: its
# layout. Every rank holds the same number of tokens, so the ring passes equal K/V shards.
#   One sequence (doc_lens None): zigzag. n = 2*cp and rank r holds chunks r and 2*cp-1-r, one early and one late,
#     so every rank owns the same share of the causal triangle.
#   Packed documents: zigzag balances one triangle only; with documents, the work of a chunk is the area of the
#     document mask in its query rows, which depends on where the documents fall. balanced_layout assigns chunks
#     to ranks by that area (largest first, each to the least loaded rank with room), a pure function of the
#     document lengths, so every rank derives the same layout with no communication.

BALANCE_CHUNKS = (2, 4, 8, 16)  # chunks per rank tried, fewest first: more chunks balance finer, launch more blocks
BALANCE_TOLERANCE = 0.02        # ... until the busiest rank's area is within this fraction of the mean
MIN_CHUNK = 128                 # tokens: a chunk below one kernel tile wastes more than it balances


def chunk_areas(doc_lens, n):
    """The document mask's area (query-key pairs, key not after query, same document) in the query rows of each of n
    equal chunks of the window -> [n] ints. A full causal window of L tokens has L*(L+1)/2 in all."""
    t = sum(doc_lens)
    c, areas, start = t // n, [0] * n, 0
    for length in doc_lens:  # a document's query at offset j sees j + 1 keys
        end = start + length
        for j in range(start // c, (end - 1) // c + 1):  # the chunks it touches
            a, b = max(start, j * c) - start, min(end, (j + 1) * c) - start
            areas[j] += (b * (b + 1) - a * (a + 1)) // 2
        start = end
    return areas


def _assign(areas, world):
    """Longest processing time first with equal counts: chunks by area, largest first, each to the least loaded rank
    that holds fewer than n / world -> (layout, busiest rank's area / mean area - 1)."""
    per_rank = len(areas) // world
    load, held = [0] * world, [[] for _ in range(world)]
    for j in sorted(range(len(areas)), key=lambda j: (-areas[j], j)):
        r = min((r for r in range(world) if len(held[r]) < per_rank), key=lambda r: (load[r], r))
        held[r].append(j)
        load[r] += areas[j]
    return tuple(tuple(sorted(h)) for h in held), max(load) * world / max(sum(load), 1) - 1


def zigzag_layout(world):
    return tuple((r, 2 * world - 1 - r) for r in range(world))


@functools.lru_cache(maxsize=64)
def balanced_layout(doc_lens, world):
    """The layout of a window of documents (their lengths, a tuple, in order) over world ranks: the fewest chunks per
    rank (BALANCE_CHUNKS, each chunk at least MIN_CHUNK tokens and the window divisible) whose _assign puts every
    rank within BALANCE_TOLERANCE of the mean area, else the best of them. A full causal window gives zigzag."""
    t = sum(doc_lens)
    if world == 1:
        return ((0,),)
    best = None
    for k in BALANCE_CHUNKS:
        n = world * k
        if t % n or (k > 2 and t // n < MIN_CHUNK):
            continue
        layout, excess = _assign(chunk_areas(doc_lens, n), world)
        if best is None or excess < best[1]:
            best = layout, excess
        if excess <= BALANCE_TOLERANCE:
            break
    if best is None:
        raise ValueError(f"a window of {t} tokens cannot be cut into 2*cp = {2 * world} equal chunks")
    return best[0]


def cp_layout(world, doc_lens=None, balanced=True):
    """Per rank, the chunks it holds (n equal chunks of the window, n = world * the length of each tuple):
    zigzag for one sequence (doc_lens None or one length) or with balanced=False, else balanced_layout."""
    if doc_lens is None or len(doc_lens) < 2 or not balanced:
        return zigzag_layout(world)
    return balanced_layout(tuple(doc_lens), world)


def cp_shard(x, dim, rank, world, doc_lens=None, balanced=True):
    """Rank's shard of x along dim: the chunks cp_layout gives it, end to end."""
    layout = cp_layout(world, doc_lens, balanced)
    n = world * len(layout[0])
    if x.shape[dim] % n:
        raise ValueError(f"sequence length L={x.shape[dim]} must be divisible by 2*cp={2 * world}")
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[j] for j in layout[rank]], dim)


def cp_unshard(shards, dim, doc_lens=None, balanced=True):
    """Inverse of cp_shard, from the list of all ranks' shards in rank order."""
    layout = cp_layout(len(shards), doc_lens, balanced)
    chunks = {}
    for held, shard in zip(layout, shards):
        chunks.update(zip(held, shard.chunk(len(held), dim)))
    return torch.cat([chunks[j] for j in sorted(chunks)], dim)


zigzag_shard, zigzag_unshard = cp_shard, cp_unshard  # the names of the design notes' contract: one sequence


def cp_positions(seq_len, rank, world, doc_lens=None, balanced=True, device=None):
    """Global position ids [seq_len // world] of rank's tokens (in the window: the RoPE positions of one sequence)."""
    return cp_shard(torch.arange(seq_len, device=device), 0, rank, world, doc_lens, balanced)


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


@functools.lru_cache(maxsize=64)
def _cu_seqlens(pieces, batch, device):
    """FA4's variable-length arguments for `batch` rows of the same pieces laid end to end: (cu_seqlens int32
    [batch * len(pieces) + 1], the longest piece)."""
    t, ends = sum(pieces), list(itertools.accumulate(pieces))
    cu = [0] + [row * t + e for row in range(batch) for e in ends]
    return torch.tensor(cu, dtype=torch.int32, device=device), max(pieces)


def _fa4_fwd(q, k, v, causal):
    from flash_attn.cute.interface import _flash_attn_fwd
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D], the model's memory
    if not isinstance(causal, tuple):
        out, lse = _flash_attn_fwd(q, k, v, causal=causal, return_lse=True)[:2]  # lse [B, Hq, Tq] fp32, natural log
        return out.transpose(1, 2), lse
    b, t = q.shape[:2]  # pieces: one variable-length call over the B*T rows, causal inside each piece
    cu, longest = _cu_seqlens(causal, b, q.device)
    out, lse = _flash_attn_fwd(*(x.reshape(b * t, *x.shape[2:]) for x in (q, k, v)), cu_seqlens_q=cu,
                               cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True,
                               return_lse=True)[:2]  # out [B*T, Hq, D], lse [Hq, B*T]
    return out.view(b, t, *out.shape[1:]).transpose(1, 2), lse.view(-1, b, t).transpose(0, 1)


def _fa4_bwd(dout, q, k, v, out, lse, causal):
    from flash_attn.cute.interface import _flash_attn_bwd
    q, k, v, out, dout = (x.transpose(1, 2) for x in (q, k, v, out, dout))
    if not isinstance(causal, tuple):
        grads = _flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
        return tuple(g.transpose(1, 2) for g in grads[:3])
    b, t = q.shape[:2]
    cu, longest = _cu_seqlens(causal, b, q.device)
    grads = _flash_attn_bwd(*(x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, out, dout)),
                            lse.transpose(0, 1).reshape(lse.shape[1], b * t), causal=True, cu_seqlens_q=cu,
                            cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    return tuple(g.view(b, t, *g.shape[1:]).transpose(1, 2) for g in grads[:3])


def _spans(pieces):
    return [slice(e - n, e) for n, e in zip(pieces, itertools.accumulate(pieces))]


def _attn_fwd(q, k, v, causal, backend="auto"):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> out [B, Hq, Tq, D] in q.dtype, lse [B, Hq, Tq] fp32 (natural log).
    causal is used only with Tq == Tk (where cuDNN's top-left and FlashAttention's bottom-right masks agree):
    query i sees keys 0..i. causal may also be a tuple of piece lengths summing to Tq == Tk (the documents of a
    chunk): causal inside each piece, nothing across. FA4 runs them in one variable-length call, the others one
    call per piece."""
    if isinstance(causal, tuple) and _kernels(backend, q.device) != "fa4":
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_acc(q))  # the kernels' lse dtype
        for s in _spans(causal):
            out[:, :, s], lse[:, :, s] = _attn_fwd(q[:, :, s], k[:, :, s], v[:, :, s], True, backend)
        return out, lse
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
    if isinstance(causal, tuple) and _kernels(backend, q.device) != "fa4":  # one call per piece
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for s in _spans(causal):
            dq[:, :, s], dk[:, :, s], dv[:, :, s] = _attn_bwd(dout[:, :, s], q[:, :, s], k[:, :, s], v[:, :, s],
                                                             out[:, :, s], lse[:, :, s], True, heads_per_call, backend)
        return dq, dk, dv
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
# chunk) pair of a ring step is intersected with the documents, and only what is left is launched. `docs` below is
# (doc_lens, balanced): balanced takes balanced_layout and runs a rank's diagonal as one block of pieces (one
# variable-length call with FA4); not balanced is the simple path: zigzag, one kernel call per document piece.

@functools.lru_cache(maxsize=16)  # a window's blocks serve every layer, forward and backward
def _doc_blocks(docs, rank, world):
    """Per ring step i (source rank - i), a tuple of this rank's (query rows, key columns, causal) blocks of the
    document mask, in local coordinates (the source's for the columns). docs: (doc_lens, balanced), doc_lens a
    tuple of 2+ positive ints.

    With the chunks of cp_layout (a ring of one has a single chunk, the whole window), each pair of a query chunk of
    this rank and a key chunk of the source, the key chunk not after the query chunk, gives:
      the same chunk: one causal block per document piece inside it (the diagonal);
      key chunk before query chunk: a document is contiguous, so only the one holding the key chunk's last token
        can reach the query chunk. If it does, one full block: its queries in the query chunk x its keys in the
        key chunk. Otherwise nothing: a pair sharing no document launches no kernel.
    balanced: the diagonal's pieces, which tile the rank's rows, become one block (all rows, all columns, causal =
    the tuple of piece lengths). Invariants (tests/test_docs.py): the blocks of all ranks and steps cover the
    document mask exactly once; the causal blocks are all at step 0, come first, and cover each local row once
    (every query sees itself), so each row is written by its causal block before any other block is merged in."""
    doc_lens, balanced = docs
    t = sum(doc_lens)
    ends = list(itertools.accumulate(doc_lens))  # document j covers [ends[j] - doc_lens[j], ends[j])
    layout = ((0,),) if world == 1 else cp_layout(world, doc_lens, balanced)
    c = t // (world * len(layout[0]))

    def chunks(r):  # (global start, local start) of rank r's chunks
        return tuple((j * c, m * c) for m, j in enumerate(layout[r]))

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
        if balanced and diagonal:
            diagonal = [(slice(None), slice(None), tuple(p.stop - p.start for p, _, _ in diagonal))]
        steps.append(tuple(diagonal + full))
    return tuple(steps)


def _ring_blocks(docs, rank, world, t):
    """Per ring step, the blocks to compute: _visible_part's one block without documents, else _doc_blocks."""
    if docs is None:
        return tuple((_visible_part(rank, (rank - i) % world, t),) for i in range(world))
    return _doc_blocks(docs, rank, world)


@functools.lru_cache(maxsize=16)
def _last_step(docs, world):
    """The last ring step at which any rank has a block: the K/V go no further round the ring. world - 1 for one
    sequence; 0 when no two ranks share a document (then nothing travels)."""
    if docs is None:
        return world - 1
    return max(i for r in range(world) for i, blocks in enumerate(_doc_blocks(docs, r, world)) if blocks)


def _one_block(steps, last):
    """Whether all of a rank's attention is one block of its own K/V over all its rows: one sequence on a ring of
    one, or balanced documents that no two ranks share (one call for the rank's pieces, no ring step after the
    first). A single block at step 0 covers every row (the causal blocks come first and cover each row once)."""
    return last == 0 and len(steps[0]) == 1


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
    """Sends tensors `shift` ranks on in the group and receives the same shapes from `shift` ranks back (shift 1:
    the next rank and the previous one). start() posts the transfer and returns the receive buffers at once; wait()
    before reading them, so the transfer runs while the caller computes (a double buffer: the current K/V and the
    next)."""

    def __init__(self, group, shift=1):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + shift) % world)
        self.prev = dist.get_global_rank(group, (rank - shift) % world)
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


def _ring_fwd(q, k, v, group, backend, docs=None):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], sharded over group (cp_shard) -> out [B, Hq, T, D] in q.dtype,
    lse [B, Hq, T] fp32. At step i this rank holds the K/V of rank - i. docs: None (one sequence) or
    (doc_lens, balanced) (_documents); the ring stops after _last_step."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    steps, last = _ring_blocks(docs, rank, world, q.shape[2]), _last_step(docs, world)
    if _one_block(steps, last):  # the kernel's own output: no fp32 buffer, nothing sent
        return _attn_fwd(q, k, v, steps[0][0][2], backend)
    out = lse = None
    if docs is not None and not docs[1]:  # pieces reach some rows only: buffers, each row first written by a piece
        out, lse = torch.empty_like(q, dtype=_acc(q)), q.new_empty(q.shape[:3], dtype=_acc(q))
    if last:
        k, v = k.contiguous(), v.contiguous()  # they are sent, and NCCL/gloo send contiguous tensors only
    ring = _Ring(group)
    for i in range(last + 1):
        if i < last:
            k_next, v_next = ring.start(k, v)
        for block in steps[i]:
            out, lse = _fwd_block(q, k, v, out, lse, block, backend)
        if i < last:
            ring.wait()
            k, v = k_next, v_next
    return out.to(q.dtype), lse  # the backward kernels take out in q's dtype


def _ring_bwd(dout, q, k, v, out, lse, group, backend, docs=None):
    """dout, q, out [B, Hq, T, D], k/v [B, Hkv, T, D], lse [B, Hq, T] fp32 -> dq, dk, dv in the inputs' dtype.
    K/V go round the ring again; dK/dV buffers (fp32) go round with them, one step behind: the buffer a
    rank holds at step i belongs to the K/V it holds, rank - i. After the last step, one more transfer, `last`
    ranks back, delivers every buffer, with all its contributions, to its owner (after a whole ring: the next
    rank). docs: as in forward, which gives the same blocks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    steps, last = _ring_blocks(docs, rank, world, q.shape[2]), _last_step(docs, world)
    if _one_block(steps, last):  # the kernel's own gradients: no fp32 accumulators, nothing sent
        return _attn_bwd(dout, q, k, v, out, lse, steps[0][0][2], backend=backend)
    dtypes = q.dtype, k.dtype, v.dtype
    if last:
        k, v = k.contiguous(), v.contiguous()
    kv_ring, grad_ring, home = _Ring(group), _Ring(group), _Ring(group, -last)
    dq = torch.zeros_like(q, dtype=_acc(q))
    dk = torch.zeros_like(k, dtype=_acc(q))
    dv = torch.zeros_like(v, dtype=_acc(q))
    for i in range(last + 1):
        if i < last:
            k_next, v_next = kv_ring.start(k, v)
        grads = [_bwd_block(dout, q, k, v, out, lse, dq, block, backend) for block in steps[i]]
        if i > 0:  # the source's buffer, sent on by the previous rank after its step i - 1
            grad_ring.wait()
            dk, dv = dk_next, dv_next
        for cols, dk_b, dv_b in grads:
            dk[:, :, cols] += dk_b
            dv[:, :, cols] += dv_b
        if i < last:
            dk_next, dv_next = grad_ring.start(dk, dv)
            kv_ring.wait()
            k, v = k_next, v_next
        elif last:  # the buffer of rank - last goes home; this rank's comes from rank + last
            dk_next, dv_next = home.start(dk, dv)
    if last:
        home.wait()
        dk, dv = dk_next, dv_next
    return tuple(g.to(dt) for g, dt in zip((dq, dk, dv), dtypes))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, backend, docs):
        out, lse = _ring_fwd(q, k, v, group, backend, docs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.backend, ctx.docs = group, backend, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        return *_ring_bwd(dout, *ctx.saved_tensors, ctx.group, ctx.backend, ctx.docs), None, None, None


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


def _documents(doc_lens, t, group, balanced):
    """doc_lens (document lengths over the whole window, in order) checked against the local length t on each
    rank of group -> docs = (a tuple of ints, balanced), the key of _doc_blocks' cache; None for one document: the
    plain ring."""
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
    return (lens, bool(balanced)) if len(lens) > 1 else None


class RingAttention:
    """The model's attn_fn: causal attention over a sequence sharded across the ranks of `group` (cp_shard, with
    the rank in `group` and the same doc_lens and balanced); a group of one is plain causal attention.
    q [B, Hq, T, D], k/v [B, Hkv, T, D] with Hkv dividing Hq, T this rank's chunks; softmax scale 1/sqrt(D).

    doc_lens: the window's documents, their lengths in order over the whole (global, unsharded) window, the same
    in every batch row; a query then sees only keys of its own document, up to itself. None or one length: one
    causal sequence. The RoPE positions inside each document are the caller's (the model's position_ids).
    balanced: with documents, the chunk layout balanced by masked area and a rank's documents in one
    variable-length call (FA4); False: zigzag and one call per document piece (the simple path, for comparison).

    backend: one of ATTN_BACKENDS, resolved once here; self.backend says which kernels run ("fa4", "cudnn",
    "flash", or "cpu" without CUDA). Calling it is differentiable; fwd and bwd are its two halves without
    autograd, for the recomputed block that keeps attention's output and lse (model.py, "Memory levers")."""

    def __init__(self, group, backend="auto", balanced=True):
        self.group, self.backend, self.balanced = group, resolve_backend(backend), balanced

    def _docs(self, doc_lens, q):
        return _documents(doc_lens, q.shape[2], self.group, self.balanced)

    def __call__(self, q, k, v, doc_lens=None):
        """-> out [B, Hq, T, D] in q.dtype."""
        _check(q, k, v, self.group)
        return _RingAttention.apply(q, k, v, self.group, self.backend, self._docs(doc_lens, q))

    def fwd(self, q, k, v, doc_lens=None):
        """-> out [B, Hq, T, D] in q.dtype, lse [B, Hq, T] fp32."""
        _check(q, k, v, self.group)
        return _ring_fwd(q, k, v, self.group, self.backend, self._docs(doc_lens, q))

    def bwd(self, dout, q, k, v, out, lse, doc_lens=None):
        """-> dq, dk, dv in the inputs' dtype. doc_lens: the forward's."""
        return _ring_bwd(dout, q, k, v, out, lse, self.group, self.backend, self._docs(doc_lens, q))


def ring_attention(q, k, v, group, backend="auto", doc_lens=None, balanced=True):
    """Causal ring attention of q [B, Hq, T, D] to k/v [B, Hkv, T, D] over `group` (see RingAttention), within
    documents when doc_lens is given. -> [B, Hq, T, D] in q.dtype. Differentiable w.r.t. q, k, v."""
    return RingAttention(group, backend, balanced)(q, k, v, doc_lens)


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
