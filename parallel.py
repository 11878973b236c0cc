"""Context parallelism (zigzag ring attention) and FSDP2 sharding, as plain functions.

Process groups and meshes are passed in as arguments; nothing here holds training state.

    python -m pytest tests/test_ring.py -q      # the ring against naive attention, 1/2/4 ranks under gloo
    python bench/ring_sim.py                    # the CUDA kernels in a simulated ring of 8 (one GPU)
"""
import functools

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# Sharding the window over the ranks of a context-parallel group
# ---------------------------------------------------------------------------------------------

# The window is cut into n equal chunks and each rank holds n / cp of them, end to end in increasing order: its
# layout. Every rank holds the same number of tokens, so the ring passes equal K/V shards. For one sequence the
# layout is zigzag: n = 2*cp and rank r holds chunks r and 2*cp-1-r, one early and one late, so every rank owns
# the same share of the causal triangle. (A window of several documents may take a layout of its own.)

def zigzag_layout(world):
    return tuple((r, 2 * world - 1 - r) for r in range(world))


def cp_shard(x, dim, rank, world, layout=None):
    """Rank's shard of x along dim: the chunks layout[rank] (a tuple per rank of the chunk indices it holds; the
    window cut into world * len(layout[0]) equal chunks) end to end. layout None: zigzag."""
    layout = zigzag_layout(world) if layout is None else layout
    n = world * len(layout[0])
    if x.shape[dim] % n:
        raise ValueError(f"sequence length L={x.shape[dim]} must be divisible by 2*cp={2 * world}")
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[j] for j in layout[rank]], dim)


def cp_unshard(shards, dim, layout=None):
    """Inverse of cp_shard, from the list of all ranks' shards in rank order."""
    chunks = {}
    for held, shard in zip(zigzag_layout(len(shards)) if layout is None else layout, shards):
        chunks.update(zip(held, shard.chunk(len(held), dim)))
    return torch.cat([chunks[j] for j in sorted(chunks)], dim)


# The ring's public functions for one causal sequence: zigzag_shard(x, dim, rank, world) cuts a rank's shard out of
# the whole sequence, zigzag_unshard(shards, dim) puts the ranks' shards back together, and ring_attention (below)
# runs causal attention on the shards.
zigzag_shard, zigzag_unshard = cp_shard, cp_unshard


# ---------------------------------------------------------------------------------------------
# The attention kernels
# ---------------------------------------------------------------------------------------------

# PyTorch's flash attention ops: they return each query row's log-sum-exp (the ring merges with it), and on CUDA
# take GQA and the model's [B, T, H, D] memory seen as [B, H, T, D] as they are (a .contiguous() would copy q, k, v
# and dout in every layer). The CPU op for CPU tensors: CI runs the whole ring under gloo. million/kernels.py has
# faster CUDA kernels.

def _attn_fwd(q, k, v, causal):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> out [B, Hq, Tq, D] in q.dtype, lse [B, Hq, Tq] fp32 (natural log).
    causal is used only with Tq == Tk: query i sees keys 0..i."""
    if q.device.type == "cpu":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]


def _attn_bwd_call(dout, q, k, v, out, lse, causal):
    if q.device.type == "cpu":
        dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    tq, tk, lse = q.shape[2], k.shape[2], lse.contiguous()
    rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout seed/offset: unused at p = 0
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, tq, tk, 0.0, causal, rng, rng)


# The backward's workspace grows with heads x length (it was the largest item at the step's memory peak); heads are
# independent, so it runs a few at a time (bench/NOTES.md, "parallel.py").
BWD_QUERY_HEADS_PER_CALL = 4


def _attn_bwd(dout, q, k, v, out, lse, causal, heads_per_call=None):
    """Gradients of one _attn_fwd call from its inputs, out (in q.dtype) and lse [B, Hq, Tq] fp32.
    -> dq [B, Hq, Tq, D], dk/dv [B, Hkv, Tk, D], in q.dtype."""
    call = functools.partial(_attn_bwd_call, causal=causal)
    return _by_head_groups(call, dout, q, k, v, out, lse, heads_per_call)


def _by_head_groups(call, dout, q, k, v, out, lse, heads_per_call=None):
    """call(dout, q, k, v, out, lse) -> (dq, dk, dv), an attention backward, run on at most heads_per_call query
    heads at a time (default BWD_QUERY_HEADS_PER_CALL): whole K/V heads with their query heads where those fit a
    call, else a K/V head's query heads over as few calls as fit, that K/V head's dk/dv summed in fp32 over them."""
    hq, hkv = q.shape[1], k.shape[1]
    per_kv, most = hq // hkv, heads_per_call or BWD_QUERY_HEADS_PER_CALL  # query heads per K/V head
    if per_kv <= most:
        kv_step = min(hkv, most // per_kv)
        while hkv % kv_step:
            kv_step -= 1
        if kv_step == hkv:
            return call(dout, q, k, v, out, lse)
        groups = [(slice(h, h + kv_step), [slice(h * per_kv, (h + kv_step) * per_kv)]) for h in range(0, hkv, kv_step)]
    else:
        n = -(-per_kv // most)
        groups = [(slice(h, h + 1), [slice(h * per_kv + i * per_kv // n, h * per_kv + (i + 1) * per_kv // n)
                                     for i in range(n)]) for h in range(hkv)]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # q's memory layout
    for kh, parts in groups:
        for i, qh in enumerate(parts):
            gq, gk, gv = call(dout[:, qh], q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh])
            dq[:, qh].copy_(gq)
            if i == 0:
                acc = gk.dtype if len(parts) == 1 else torch.promote_types(gk.dtype, torch.float32)
                sk, sv = gk.to(acc), gv.to(acc)
            else:
                sk += gk
                sv += gv
        dk[:, kh].copy_(sk)
        dv[:, kh].copy_(sv)
    return dq, dk, dv


class FlashKernels:
    """The ring's attention kernels unless it is given others (kernels.Kernels): the two functions above."""

    def fwd(self, q, k, v, causal):
        return _attn_fwd(q, k, v, causal)

    def bwd(self, dout, q, k, v, out, lse, causal):
        return _attn_bwd(dout, q, k, v, out, lse, causal)


# ---------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------

# Ring attention passes the K/V shards (the KV heads only) round the ranks while each rank attends to them,
# and merges the partial results with their log-sum-exp. Layout after zhuzilin/ring-flash-attention's zigzag
# variant: a forward, a backward and a thin autograd.Function that only saves tensors. Tested in
# tests/test_ring.py (CPU, gloo) and tests/test_fa4.py (GPU, NCCL); bench/ring_sim.py times the CUDA kernels.

class Schedule:
    """What the ring computes on one rank. steps[i]: the blocks (query rows, key columns, causal) of ring step i,
    when this rank holds the K/V of rank - i, rows and columns in local coordinates (the source's for the columns);
    last: the last step at which any rank has a block (the K/V go no further round the ring). The causal blocks are
    all at step 0, come first and cover each local row once, so that each row is written before anything is merged
    into it. fwd/bwd compute one block on the ring's kernels; a subclass may run some otherwise."""

    def __init__(self, steps, last):
        self.steps, self.last = steps, last

    def fwd(self, q, k, v, causal, kernels):
        return kernels.fwd(q, k, v, causal)

    def bwd(self, dout, q, k, v, out, lse, causal, kernels):
        return kernels.bwd(dout, q, k, v, out, lse, causal)

    def one_block(self):
        """Whether all of the rank's attention is one block of its own K/V over all its rows (a ring of one, say):
        then the kernel's own output is the result, with no fp32 buffer and nothing sent."""
        return self.last == 0 and len(self.steps[0]) == 1


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


def zigzag_schedule(rank, world, t, doc_lens=None):
    """The schedule of one causal sequence in the zigzag layout, t tokens on each rank: one _visible_part a step."""
    if doc_lens is not None:
        raise ValueError("doc_lens: this ring runs one causal sequence; a window of documents needs a schedule "
                         "that knows them (RingAttention(group, kernels, schedule))")
    return Schedule(tuple((_visible_part(rank, (rank - i) % world, t),) for i in range(world)), world - 1)


def _acc(q):
    """The merge's and the gradient accumulators' dtype: fp32, or float64 for float64 inputs (the CPU tests)."""
    return torch.promote_types(q.dtype, torch.float32)


def _fwd_block(q, k, v, out, lse, block, schedule, kernels):
    """Attend the local q [B, Hq, T, D] to one block (rows, cols, causal) of a source's k/v [B, Hkv, T, D] and
    fold the result into the running out [B, Hq, T, D] / lse [B, Hq, T] (_acc: fp32, or float64 for float64
    inputs; None before the first block). A causal block is the first to reach its rows (Schedule): it is
    written, not merged, so no row is merged before it holds a finite lse."""
    rows, cols, causal = block
    out_b, lse_b = schedule.fwd(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, kernels)
    if out is None:
        if rows == slice(None):  # the first block covers every row
            return out_b.to(_acc(q)), lse_b.to(_acc(q))
        out, lse = torch.empty_like(q, dtype=_acc(q)), q.new_empty(q.shape[:3], dtype=_acc(q))
    o, l = out[:, :, rows], lse[:, :, rows]  # views: updated in place
    if causal:  # the first block to reach these rows
        o.copy_(out_b)
        l.copy_(lse_b)
        return out, lse
    # softmax over the union of both key sets, in fp32; lerp(o, out_b, w) = o - w*(o - out_b)
    o.lerp_(out_b.to(o.dtype), torch.sigmoid(lse_b - l).unsqueeze(-1))
    l.sub_(torch.nn.functional.logsigmoid(l - lse_b))  # = log(exp(l) + exp(lse_b))
    return out, lse


def _bwd_block(dout, q, k, v, out, lse, dq, block, schedule, kernels):
    """The backward of one block (rows, cols, causal), with the final out (q.dtype) and lse: adds the block's
    dQ into dq [B, Hq, T, D] (_acc) and returns (cols, dk_b, dv_b), the gradient of the source's K/V columns."""
    rows, cols, causal = block
    dq_b, dk_b, dv_b = schedule.bwd(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                    out[:, :, rows], lse[:, :, rows], causal, kernels)
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


def _ring_fwd(q, k, v, group, kernels, schedule):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], sharded over group (cp_shard) -> out [B, Hq, T, D] in q.dtype,
    lse [B, Hq, T] fp32. At step i this rank holds the K/V of rank - i and computes schedule.steps[i]; the ring
    stops after schedule.last."""
    if schedule.one_block():
        return schedule.fwd(q, k, v, schedule.steps[0][0][2], kernels)
    out = lse = None
    last = schedule.last
    if last:
        k, v = k.contiguous(), v.contiguous()  # they are sent, and NCCL/gloo send contiguous tensors only
    ring = _Ring(group)
    for i in range(last + 1):
        if i < last:
            k_next, v_next = ring.start(k, v)
        for block in schedule.steps[i]:
            out, lse = _fwd_block(q, k, v, out, lse, block, schedule, kernels)
        if i < last:
            ring.wait()
            k, v = k_next, v_next
    return out.to(q.dtype), lse  # the backward kernels take out in q's dtype


def _ring_bwd(dout, q, k, v, out, lse, group, kernels, schedule):
    """dout, q, out [B, Hq, T, D], k/v [B, Hkv, T, D], lse [B, Hq, T] fp32 -> dq, dk, dv in the inputs' dtype.
    K/V go round the ring again; dK/dV buffers (fp32) go round with them, one step behind: the buffer a
    rank holds at step i belongs to the K/V it holds, rank - i. After the last step, one more transfer, `last`
    ranks back, delivers every buffer, with all its contributions, to its owner (after a whole ring: the next
    rank). schedule: the forward's."""
    if schedule.one_block():
        return schedule.bwd(dout, q, k, v, out, lse, schedule.steps[0][0][2], kernels)
    dtypes, last = (q.dtype, k.dtype, v.dtype), schedule.last
    if last:
        k, v = k.contiguous(), v.contiguous()
    kv_ring, grad_ring, home = _Ring(group), _Ring(group), _Ring(group, -last)
    dq = torch.zeros_like(q, dtype=_acc(q))
    dk = torch.zeros_like(k, dtype=_acc(q))
    dv = torch.zeros_like(v, dtype=_acc(q))
    for i in range(last + 1):
        if i < last:
            k_next, v_next = kv_ring.start(k, v)
        grads = [_bwd_block(dout, q, k, v, out, lse, dq, block, schedule, kernels) for block in schedule.steps[i]]
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
    def forward(ctx, q, k, v, group, kernels, schedule):
        out, lse = _ring_fwd(q, k, v, group, kernels, schedule)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernels, ctx.schedule = group, kernels, schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        return *_ring_bwd(dout, *ctx.saved_tensors, ctx.group, ctx.kernels, ctx.schedule), None, None, None


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


class RingAttention:
    """The model's attn_fn: causal attention over a sequence sharded across the ranks of `group` (cp_shard, with
    the rank in `group`); a group of one is plain causal attention.
    q [B, Hq, T, D], k/v [B, Hkv, T, D] with Hkv dividing Hq, T this rank's chunks; softmax scale 1/sqrt(D).

    kernels: the attention kernels of a block (fwd, bwd as FlashKernels has them; on CUDA the caller passes the
    fastest it has). schedule(rank, world, T, *docs) -> Schedule: the blocks the ring computes, from what the model
    passes after q, k, v. The default, zigzag_schedule, is one causal sequence; a schedule that takes the window's
    document lengths computes only the blocks inside its documents.

    Calling it is differentiable; fwd and bwd are its two halves without autograd, for the recomputed block that
    keeps attention's output and lse (model.py, "Memory levers")."""

    def __init__(self, group, kernels=None, schedule=zigzag_schedule):
        self.group, self.kernels, self.schedule = group, kernels or FlashKernels(), schedule

    def _schedule(self, q, docs):
        return self.schedule(dist.get_rank(self.group), dist.get_world_size(self.group), q.shape[2], *docs)

    def __call__(self, q, k, v, *docs):
        """-> out [B, Hq, T, D] in q.dtype."""
        _check(q, k, v, self.group)
        return _RingAttention.apply(q, k, v, self.group, self.kernels, self._schedule(q, docs))

    def fwd(self, q, k, v, *docs):
        """-> out [B, Hq, T, D] in q.dtype, lse [B, Hq, T] fp32."""
        _check(q, k, v, self.group)
        return _ring_fwd(q, k, v, self.group, self.kernels, self._schedule(q, docs))

    def bwd(self, dout, q, k, v, out, lse, *docs):
        """-> dq, dk, dv in the inputs' dtype. docs: the forward's."""
        return _ring_bwd(dout, q, k, v, out, lse, self.group, self.kernels, self._schedule(q, docs))


def ring_attention(q, k, v, group, kernels=None):
    """Causal ring attention of one sequence, q [B, Hq, T, D] to k/v [B, Hkv, T, D] sharded over `group` with
    zigzag_shard (see RingAttention). -> [B, Hq, T, D] in q.dtype. Differentiable w.r.t. q, k, v."""
    return RingAttention(group, kernels)(q, k, v)


# ---------------------------------------------------------------------------------------------
# FSDP2 and gradient clipping
# ---------------------------------------------------------------------------------------------

def shard_model(model, mesh, param_dtype, reduce_dtype=torch.float32):
    """FSDP2 over every rank of `mesh`: each block is a unit, the final norm one, then the root (embedding, head).

    The final norm is a unit of its own: its backward reads its weight. The rest of the root serves the forward
    alone: the loss makes the head's gradients during the forward (loss.py), and the embedding's backward reads
    no weight. So the root is resharded after its forward and not gathered again in backward: its full copy
    (V x H twice when the head is untied: 3.8 GiB for Qwen3.5-9B) is not held through the blocks' backward,
    where the peak is.
    Gradients are summed, not averaged, over ranks: the loss is already divided by the global token count,
    and ranks of one context-parallel group hold different parts of the same sequence."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model.norm, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    model.set_unshard_in_backward(False)
    for m in (*model.layers, model.norm, model):
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

def agree(flags: list, device, group=None) -> list[float]:
    """One collective: each value the largest any rank has (a flag: true on every rank if true on any)."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


ELSEWHERE = "failed on another rank (see its message)"  # all_ok's pointer: said by the failing rank, so not said


def all_ok(error: str | None, what: str, device, exc=SystemExit):
    """A collective check that every rank succeeded at `what` (error None): if one did not, every rank raises
    exc together, the failing one with its own message, the others pointing to it (which stays unprinted)."""
    if agree([error is not None], device)[0]:
        raise exc(error or f"error: {what} {ELSEWHERE}; stopping")
