"""Windows of packed documents under the ring: a query sees only the keys of its own document, up to itself.

An extension of parallel.py. A window may hold several documents laid end to end (doc_lens: their lengths, in
order, summing to the window's length). This file gives the ring what changes with them:
- the chunk layout over the ranks, balanced by the document mask's area (cp_layout, for the data's sharding);
- the ring's block schedule (schedule, for RingAttention): each (query chunk, key chunk) pair of a ring step is
  intersected with the documents and only what is left is launched; a rank's own pieces run as one
  variable-length call with FA4;
- the same masked attention on one device, through a [T, T] mask (masked_attention: tests, short evaluation);
- the masked area a window costs, for the cost model (document_area, parse_doc_lens: plan.py).

    python -m pytest tests/test_docs.py tests/test_balance.py -q   # against naive masked attention, 1/2/4 ranks
"""
import bisect
import functools
import itertools
import operator

import torch
import torch.nn.functional as F

import parallel
from model import causal_attention

# ---------------------------------------------------------------------------------------------
# The layout: which chunks of the window each rank holds
# ---------------------------------------------------------------------------------------------

# Zigzag balances one triangle only; with documents, the work of a chunk is the area of the document mask in its
# query rows, which depends on where the documents fall. balanced_layout assigns chunks to ranks by that area
# (largest first, each to the least loaded rank with room), a pure function of the document lengths, so every
# rank derives the same layout with no communication.

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
    """Per rank, the chunks it holds (parallel.cp_shard's layout): zigzag for one sequence (doc_lens None or one
    length) or with balanced=False, else balanced_layout."""
    if doc_lens is None or len(doc_lens) < 2 or not balanced:
        return parallel.zigzag_layout(world)
    return balanced_layout(tuple(doc_lens), world)


def document_area(doc_lens, cp, balanced=True) -> float:
    """plan.Shape.attn_area of a window of documents (their lengths, in order) over cp ranks sharded as train.py
    shards it (cp_layout): the busiest rank's area of the document mask over its share of the full triangle."""
    t = sum(doc_lens)
    layout = cp_layout(cp, tuple(doc_lens), balanced)
    areas = chunk_areas(doc_lens, cp * len(layout[0]))
    return max(sum(areas[j] for j in held) for held in layout) / (t * (t + 1) / 2 / cp)


def parse_doc_lens(text: str) -> tuple:
    """'65536,65536' or '4x65536' or '2x8192,16384' -> a tuple of document lengths."""
    try:
        out = []
        for item in text.split(","):
            n, _, length = item.strip().rpartition("x")
            out += [int(length)] * int(n or 1)
    except ValueError:
        raise ValueError(f"--doc_lens {text!r}: want lengths separated by commas, each LENGTH or COUNTxLENGTH, "
                         "e.g. 4x65536 or 8192,16384") from None
    if not out or min(out) < 1:
        raise ValueError(f"--doc_lens {text!r}: document lengths must be positive")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The ring's schedule: the blocks of the document mask
# ---------------------------------------------------------------------------------------------

# balanced (the default) takes balanced_layout and runs a rank's diagonal as one block of pieces (one
# variable-length call with FA4); not balanced is the simple path: zigzag, one kernel call per document piece.

@functools.lru_cache(maxsize=16)  # a window's blocks serve every layer, forward and backward
def _doc_blocks(doc_lens, balanced, rank, world):
    """-> (steps, pieces). steps: per ring step i (source rank - i), a tuple of this rank's (query rows, key
    columns, causal) blocks of the document mask, in local coordinates (the source's for the columns); doc_lens a
    tuple of 2+ positive ints. pieces: with balanced, the lengths of the documents' pieces in the rank's diagonal
    block, else None.

    With the chunks of cp_layout (a ring of one has a single chunk, the whole window), each pair of a query chunk of
    this rank and a key chunk of the source, the key chunk not after the query chunk, gives:
      the same chunk: one causal block per document piece inside it (the diagonal);
      key chunk before query chunk: a document is contiguous, so only the one holding the key chunk's last token
        can reach the query chunk. If it does, one full block: its queries in the query chunk x its keys in the
        key chunk. Otherwise nothing: a pair sharing no document launches no kernel.
    balanced: the diagonal's pieces, which tile the rank's rows, become one causal block (all rows, all columns)
    whose kernels keep to the pieces. Invariants (tests/test_docs.py): the blocks of all ranks and steps cover the
    document mask exactly once; the causal blocks are all at step 0, come first, and cover each local row once
    (every query sees itself), as parallel.Schedule asks."""
    t = sum(doc_lens)
    ends = list(itertools.accumulate(doc_lens))  # document j covers [ends[j] - doc_lens[j], ends[j])
    layout = ((0,),) if world == 1 else cp_layout(world, doc_lens, balanced)
    c = t // (world * len(layout[0]))

    def chunks(r):  # (global start, local start) of rank r's chunks
        return tuple((j * c, m * c) for m, j in enumerate(layout[r]))

    steps, pieces = [], None
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
            pieces = tuple(p.stop - p.start for p, _, _ in diagonal)
            diagonal = [(slice(None), slice(None), True)]
        steps.append(tuple(diagonal + full))
    return tuple(steps), pieces


@functools.lru_cache(maxsize=16)
def _last_step(doc_lens, balanced, world):
    """The last ring step at which any rank has a block: the K/V go no further round the ring. 0 when no two ranks
    share a document (then nothing travels)."""
    return max(i for r in range(world) for i, blocks in enumerate(_doc_blocks(doc_lens, balanced, r, world)[0])
               if blocks)


class DocumentSchedule(parallel.Schedule):
    """The ring's blocks on one rank for a window of documents (_doc_blocks); with balanced, the rank's diagonal is
    one causal block whose kernels run causal attention inside each of its pieces and nothing across."""

    def __init__(self, doc_lens, balanced, rank, world):
        steps, self.pieces = _doc_blocks(doc_lens, balanced, rank, world)
        super().__init__(steps, _last_step(doc_lens, balanced, world))

    def fwd(self, q, k, v, causal, kernels):
        if causal and self.pieces:
            return _pieces_fwd(q, k, v, self.pieces, kernels)
        return kernels.fwd(q, k, v, causal)

    def bwd(self, dout, q, k, v, out, lse, causal, kernels):
        if causal and self.pieces:
            return _pieces_bwd(dout, q, k, v, out, lse, self.pieces, kernels)
        return kernels.bwd(dout, q, k, v, out, lse, causal)


def _checked_lens(doc_lens, t, world):
    """doc_lens (document lengths over the whole window, in order) checked against the local length t on each of
    world ranks -> a tuple of ints."""
    try:
        lens = tuple(operator.index(n) for n in doc_lens)
    except TypeError:
        raise ValueError(f"doc_lens must be a sequence of ints (document lengths); got {doc_lens!r:.200}") from None
    if not lens or min(lens) < 1 or sum(lens) != t * world:
        raise ValueError(f"doc_lens must be positive lengths summing to the window's {t * world} tokens ({t} on "
                         f"each of {world} ranks); got {len(lens)} lengths, sum {sum(lens)}, "
                         f"min {min(lens, default=0)}")
    return lens


def schedule(rank, world, t, doc_lens=None, balanced=True):
    """RingAttention's schedule (parallel.Schedule) on `rank` of `world`, t tokens each, for a window of documents:
    doc_lens, their lengths in order over the whole (global, unsharded) window, the same in every batch row; the
    data sharded with cp_layout(world, doc_lens, balanced). None or one length: one causal sequence (zigzag).
    balanced: with documents, the chunk layout balanced by masked area and a rank's documents in one
    variable-length call (FA4); False: zigzag and one call per document piece (the simple path, for comparison).
    The RoPE positions inside each document are the caller's (the model's position_ids)."""
    if doc_lens is None:
        return parallel.zigzag_schedule(rank, world, t)
    lens = _checked_lens(doc_lens, t, world)
    if len(lens) == 1:
        return parallel.zigzag_schedule(rank, world, t)
    return DocumentSchedule(lens, bool(balanced), rank, world)


# ---------------------------------------------------------------------------------------------
# The kernels of a block of pieces: causal inside each piece, nothing across
# ---------------------------------------------------------------------------------------------

def _spans(pieces):
    return [slice(e - n, e) for n, e in zip(pieces, itertools.accumulate(pieces))]


@functools.lru_cache(maxsize=64)
def _cu_seqlens(pieces, batch, device):
    """FA4's variable-length arguments for `batch` rows of the same pieces laid end to end: (cu_seqlens int32
    [batch * len(pieces) + 1], the longest piece)."""
    t, ends = sum(pieces), list(itertools.accumulate(pieces))
    cu = [0] + [row * t + e for row in range(batch) for e in ends]
    return torch.tensor(cu, dtype=torch.int32, device=device), max(pieces)


def _fa4_pieces_fwd(q, k, v, pieces):
    from flash_attn.cute.interface import _flash_attn_fwd
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D], the model's memory
    b, t = q.shape[:2]  # one variable-length call over the B*T rows, causal inside each piece
    cu, longest = _cu_seqlens(pieces, b, q.device)
    out, lse = _flash_attn_fwd(*(x.reshape(b * t, *x.shape[2:]) for x in (q, k, v)), cu_seqlens_q=cu,
                               cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True,
                               return_lse=True)[:2]  # out [B*T, Hq, D], lse [Hq, B*T]
    return out.view(b, t, *out.shape[1:]).transpose(1, 2), lse.view(-1, b, t).transpose(0, 1)


def _fa4_pieces_bwd(dout, q, k, v, out, lse, pieces):
    from flash_attn.cute.interface import _flash_attn_bwd
    q, k, v, out, dout = (x.transpose(1, 2) for x in (q, k, v, out, dout))
    b, t = q.shape[:2]
    cu, longest = _cu_seqlens(pieces, b, q.device)
    grads = _flash_attn_bwd(*(x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, out, dout)),
                            lse.transpose(0, 1).reshape(lse.shape[1], b * t), causal=True, cu_seqlens_q=cu,
                            cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    return tuple(g.view(b, t, *g.shape[1:]).transpose(1, 2) for g in grads[:3])


def _fa4(kernels, q):
    """Whether the ring's kernels are FlashAttention-4's (kernels.Kernels("fa4"), or "auto" where it runs) and q
    is on the GPU: then a block of pieces is one variable-length call."""
    return getattr(kernels, "backend", None) == "fa4" and q.device.type != "cpu"


def _pieces_fwd(q, k, v, pieces, kernels):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], pieces: lengths summing to T -> out [B, Hq, T, D] in q.dtype, lse
    [B, Hq, T] fp32. FA4 runs them in one variable-length call, the other kernels one call per piece."""
    if _fa4(kernels, q):
        return _fa4_pieces_fwd(q, k, v, pieces)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=parallel._acc(q))  # the kernels' lse dtype
    for s in _spans(pieces):
        out[:, :, s], lse[:, :, s] = kernels.fwd(q[:, :, s], k[:, :, s], v[:, :, s], True)
    return out, lse


def _pieces_bwd(dout, q, k, v, out, lse, pieces, kernels):
    """Gradients of one _pieces_fwd call -> dq [B, Hq, T, D], dk/dv [B, Hkv, T, D], in q.dtype."""
    if _fa4(kernels, q):
        call = functools.partial(_fa4_pieces_bwd, pieces=pieces)
        return parallel._by_head_groups(call, dout, q, k, v, out, lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for s in _spans(pieces):
        dq[:, :, s], dk[:, :, s], dv[:, :, s] = kernels.bwd(dout[:, :, s], q[:, :, s], k[:, :, s], v[:, :, s],
                                                            out[:, :, s], lse[:, :, s], True)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# On one device
# ---------------------------------------------------------------------------------------------

def masked_attention(q, k, v, doc_lens=None):
    """attn_fn on one device for windows of documents: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D].
    doc_lens (lengths summing to T): a query sees only its own document's keys, through a [T, T] mask (tests and
    short evaluation; the ring never builds one). None: model.causal_attention."""
    if doc_lens is None:
        return causal_attention(q, k, v)
    if sum(doc_lens) != q.shape[2]:
        raise ValueError(f"doc_lens sum to {sum(doc_lens)}, not to the {q.shape[2]} tokens of the window")
    doc = torch.arange(len(doc_lens), device=q.device).repeat_interleave(torch.tensor(doc_lens, device=q.device))
    mask = (doc[:, None] == doc[None, :]).tril()  # [T, T]: same document, key not after query
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
