"""Windows of several documents (doc_lens): ring attention inside documents (documents.py) against a naive fp64
oracle with the document mask, at cp 1, 2 and 4 under gloo; our Qwen3 on a packed window against each document
run alone through transformers' Qwen3ForCausalLM. CPU; the tests marked gpu check the CUDA kernels.

    python -m pytest tests/test_docs.py -q

Each world size starts its ranks once (tests/test_ring.py's run_ranks): every rank runs all CASES in every
document layout, and a packed window through the model, and saves its shards; the parent gathers and compares.
"""
import functools
import itertools
import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers  # a test dependency: the independent reference for the model

from million import documents
from million import hf as H
from million import kernels
import model as M
from million.documents import DocumentSchedule, cp_layout, masked_attention
from model import Qwen3, Qwen3Config
from parallel import RingAttention, cp_shard, cp_unshard, ring_attention
from test_fa4 import rel
from test_ring import _free_port, _record_blocks, cp_positions, make_inputs, run_ranks

# (batch, q heads, kv heads, chunk length, head_dim, dtype); the window is 2 * world * chunk tokens
CASES = [(1, 5, 1, 7, 8, torch.float64), (2, 6, 2, 6, 12, torch.float32)]
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def layouts(world, chunk):
    """Named document layouts (lengths) of a window of 2 * world * chunk tokens, chunk >= 6."""
    n = 2 * world * chunk

    def cut(*points):  # the lengths between cut points inside (0, n)
        edges = [0, *sorted({p for p in points if 0 < p < n}), n]
        return tuple(b - a for a, b in zip(edges, edges[1:]))
    return {
        # documents across chunk and rank boundaries; one token long at both ends
        "crossing": cut(1, chunk - 1, chunk + 2, 2 * chunk + 3, 3 * chunk + 1, 5 * chunk - 2, n - 1),
        # many short documents in the first chunk, the last of them running into the second
        "short": cut(1, 3, 4, 5, chunk + 2),
        # no two chunks share a document: the ring steps after the first launch nothing
        "chunks": (chunk,) * (2 * world),
        # two chunks each, offset by one: some pairs of ranks share a document at some steps, others none
        "pairs": cut(*range(chunk, n, 2 * chunk)),
        "whole": (n,),  # one document: the plain causal ring
    }


def doc_mask(doc_lens, device=None):
    """[n, n] bool: query i sees key j when both lie in one document and j <= i."""
    n = sum(doc_lens)
    keep, start = torch.zeros(n, n, dtype=torch.bool, device=device), 0
    for length in doc_lens:
        keep[start:start + length, start:start + length] = True
        start += length
    return keep.tril()


def naive_doc_attention(q, k, v, doc_lens):
    """q [B, Hq, L, D], k/v [B, Hkv, L, D]: the full [L x L] scores with the document mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~doc_mask(doc_lens, q.device), float("-inf")).softmax(-1) @ v


def expected_calls(doc_lens, rank, world):
    """Kernel calls the simple path makes on a rank, each way: per query chunk of its own and key chunk not after
    it, one per document the two share (a ring of one has a single chunk, the whole window)."""
    doc = torch.arange(len(doc_lens)).repeat_interleave(torch.tensor(doc_lens))
    n = 1 if world == 1 else 2 * world
    in_chunk = [set(c.tolist()) for c in doc.chunk(n)]
    mine = (0,) if world == 1 else (rank, n - 1 - rank)
    return sum(len(in_chunk[qc] & in_chunk[kc]) for qc in mine for kc in range(qc + 1))


# --- the model on a packed window ---

def tiny_model(dtype):
    """A random Qwen3 with weights large enough that attention is far from uniform (QK-norm, 6 q / 2 kv heads)."""
    cfg = Qwen3Config.tiny(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=8, initializer_range=0.25)
    m = Qwen3(cfg).to(dtype)
    gen = torch.Generator().manual_seed(0)
    m.init_weights(gen)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
    return m


def packed(doc_lens, vocab=97, seed=0):
    """input_ids, position_ids (inside each document, from 0) and labels (the next token of the same document;
    -100 at each document's last token) [1, n] of a window of documents laid end to end."""
    ids = torch.randint(0, vocab, (1, sum(doc_lens)), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(length) for length in doc_lens])[None]
    labels, start = torch.full_like(ids, -100), 0
    for length in doc_lens:
        labels[0, start:start + length - 1] = ids[0, start + 1:start + length]
        start += length
    return ids, pos, labels


def nll_and_grads(m, ids, pos, labels, doc_lens):
    """Per-token NLL [T] from the full logits (0 where not trained) and the gradients of the loss sum."""
    with torch.no_grad():
        nll = F.cross_entropy(m.logits(ids, pos, doc_lens)[0], labels[0], reduction="none")
    m.zero_grad(set_to_none=True)
    loss, _ = m(ids, pos, labels, loss_chunk=7, doc_lens=doc_lens)
    loss.backward()
    return nll, {n: p.grad.clone() for n, p in m.named_parameters()}


def alone_in_transformers(m, ids, labels, doc_lens, folder):
    """The oracle: each document run alone from position 0 through transformers' Qwen3ForCausalLM on m's weights
    -> per-token NLL [T] (0 where not trained) and the gradients of their sum, under our parameter names."""
    H.save_pretrained(m, str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=m.embed_tokens.weight.dtype)
    nll, start = [], 0
    for length in doc_lens:
        doc = slice(start, start + length)
        nll.append(F.cross_entropy(hf(ids[:, doc]).logits[0], labels[0, doc], reduction="none"))
        start += length
    nll = torch.cat(nll)
    nll.sum().backward()
    hf_params = dict(hf.named_parameters())
    return nll.detach(), {n: hf_params[H.hf_name(n)].grad for n, _ in m.named_parameters()}


def assert_grads_close(got, want, bound):
    for n, g in want.items():
        assert rel(got[n], g.double()) < bound, (n, rel(got[n], g.double()))


MODEL_CHUNK = 5  # the model's window on the ranks: 2 * world * 5 tokens, in the "crossing" layout


# --- the ranks ---

def _rank_main(rank, world, port, out_dir):
    torch.set_num_threads(1)
    documents.MIN_CHUNK = 1  # let these tiny windows take balanced layouts of more than two chunks per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group, calls, results = dist.group.WORLD, [], {}
        depth = _record_blocks(calls)
        _record_blocks(calls, documents, ("_pieces_fwd", "_pieces_bwd"), depth)
        for balanced in BALANCED:
            attn = RingAttention(group, schedule=schedule_of(balanced))
            for i, case in enumerate(CASES):
                for name, doc_lens in layouts(world, case[3]).items():
                    q, k, v, dout = (cp_shard(x.to(case[5]), 2, rank, world, cp_layout(world, doc_lens, balanced))
                                     for x in make_inputs(case[:5], world))
                    q, k, v = (x.requires_grad_() for x in (q, k, v))
                    calls.clear()
                    out = attn(q, k, v, doc_lens)
                    out.backward(dout)
                    r = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, calls=list(calls))
                    q, k, v = q.detach(), k.detach(), v.detach()
                    out, lse = attn.fwd(q, k, v, doc_lens)  # the keep-attention halves
                    r["halves"] = dict(zip(("out", "dq", "dk", "dv"),
                                           (out, *attn.bwd(dout, q, k, v, out, lse, doc_lens))))
                    if name == "whole":
                        out = ring_attention(*(x.requires_grad_() for x in (q, k, v)), group)
                        out.backward(dout)
                        r["plain"] = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
                    results[i, name, balanced] = r
        # A packed window through the model, as train.py passes it: tokens, labels and positions sharded,
        # doc_lens of the whole window; recompute with kept attention runs the ring's fwd/bwd halves.
        doc_lens = layouts(world, MODEL_CHUNK)["crossing"]
        m = tiny_model(torch.float64).set_levers(recompute=True, keep_attention=True)
        m.attn_fn = RingAttention(group, schedule=documents.schedule)
        ids, pos, labels = (cp_shard(x, 1, rank, world, cp_layout(world, doc_lens)) for x in packed(doc_lens))
        results["model"] = nll_and_grads(m, ids, pos, labels, doc_lens)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fine_chunks():
    """MIN_CHUNK = 1 here, as in the ranks (_rank_main): tiny windows take balanced layouts of more than two chunks
    per rank, and the layouts this process derives to gather the ranks' shards are theirs."""
    def clear():
        for cached in (documents.balanced_layout, documents._doc_blocks, documents._last_step):
            cached.cache_clear()
    old, documents.MIN_CHUNK = documents.MIN_CHUNK, 1
    clear()
    yield
    documents.MIN_CHUNK = old
    clear()


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"cp{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(world, tmp_path_factory.mktemp(f"cp{world}"), main=_rank_main)


BALANCED = (True, False)  # the balanced layout with a rank's documents in one call; the simple path


def schedule_of(balanced):
    """RingAttention's schedule argument for windows of documents, balanced or the simple path."""
    return functools.partial(documents.schedule, balanced=balanced)


def gathered(ranks, key, what, doc_lens, balanced):
    return cp_unshard([r[key][what] for r in ranks], 2, cp_layout(len(ranks), doc_lens, balanced))


def test_ring_with_documents_matches_oracle(ranks):
    world, ranks = ranks
    for i, case in enumerate(CASES):
        for name, doc_lens in layouts(world, case[3]).items():
            q, k, v, dout = (x.double().requires_grad_() for x in make_inputs(case[:5], world))
            out = naive_doc_attention(q, k, v, doc_lens)
            want = dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))))
            for balanced in BALANCED:
                key = i, name, balanced
                for what, ref in want.items():
                    got = gathered(ranks, key, what, doc_lens, balanced)
                    assert got.dtype == case[5]
                    torch.testing.assert_close(got.double(), ref, **TOL[case[5]], msg=lambda m: (
                        f"{what}, {name} {doc_lens}, case {case}, cp {world}, balanced {balanced}: {m}"))
                    # the keep-attention halves (fwd, bwd) are the autograd path, bit for bit
                    halves = gathered([{key: r[key]["halves"]} for r in ranks], key, what, doc_lens, balanced)
                    assert torch.equal(halves, got), (what, name, case)
                if name == "whole":  # one document is today's ring, bit for bit
                    for what in want:
                        plain = cp_unshard([r[key]["plain"][what] for r in ranks], 2)
                        assert torch.equal(plain, gathered(ranks, key, what, doc_lens, balanced)), (what, case)


def block_area(tq, tk, mask):
    """Query-key pairs one kernel call computes, by the mask its call was recorded with (_record_blocks): causal
    (True), full (False), or the lengths of pieces (a pieces block: causal inside each)."""
    if isinstance(mask, tuple):
        return sum(n * (n + 1) // 2 for n in mask)
    return tq * (tq + 1) // 2 if mask else tq * tk


def test_only_blocks_sharing_a_document_launch(ranks):
    """Kernel calls per rank, forward and backward. Simple path: one per (query chunk, key chunk, shared document),
    none for a pair that shares no document. Balanced: the same, but a rank's diagonal pieces are one call. Either
    way the calls compute exactly the document mask's query-key pairs."""
    world, ranks = ranks
    for i, case in enumerate(CASES):
        for name, doc_lens in layouts(world, case[3]).items():
            for balanced in BALANCED:
                for kind in ("fwd", "bwd"):
                    per_rank = [[c for c in r[i, name, balanced]["calls"] if c[0] == kind] for r in ranks]
                    if name == "whole":  # the plain ring: one call per step
                        assert [len(c) for c in per_rank] == [world] * world
                        continue
                    if balanced:  # the diagonal first, one call; then one per full block of _doc_blocks
                        assert all(isinstance(c[0][3], tuple) for c in per_rank)
                        want = [sum(map(len, DocumentSchedule(doc_lens, True, r, world).steps)) for r in range(world)]
                    else:
                        want = [expected_calls(doc_lens, rank, world) for rank in range(world)]
                        if name == "chunks":  # only the two diagonal blocks of step 0, on every rank
                            assert want == [2] * world
                    assert [len(c) for c in per_rank] == want, (kind, name, doc_lens, balanced)
                    area = sum(block_area(*c[1:]) for calls in per_rank for c in calls)
                    assert area == int(doc_mask(doc_lens).sum()), (kind, name, balanced)


def test_model_on_ranks_matches_each_document_alone(ranks, tmp_path):
    """cp 1, 2, 4: the per-token NLL and the gradients (summed over ranks) of a packed window equal those of each
    document run alone through transformers."""
    world, ranks = ranks
    doc_lens = layouts(world, MODEL_CHUNK)["crossing"]
    ids, pos, labels = packed(doc_lens)
    ref_nll, ref_grads = alone_in_transformers(tiny_model(torch.float64), ids, labels, doc_lens, tmp_path)
    nll = cp_unshard([r["model"][0] for r in ranks], 0, cp_layout(world, doc_lens))
    # transformers forms RoPE angles in fp32 (we use float64): ~1e-7 here; a leak across documents is ~1e-2
    torch.testing.assert_close(nll, ref_nll, atol=1e-5, rtol=1e-5)
    grads = {n: sum(r["model"][1][n] for r in ranks) for n in ref_grads}
    assert_grads_close(grads, ref_grads, 1e-5)


# --- in one process ---

@pytest.fixture(scope="module")
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def block_mask(tq, tk, mask):
    """[tq, tk] int64: the pairs one block computes (see block_area)."""
    if isinstance(mask, tuple):
        return torch.block_diag(*(torch.ones(n, n, dtype=torch.int64).tril() for n in mask))
    block = torch.ones(tq, tk, dtype=torch.int64)
    return block.tril() if mask else block


@pytest.mark.parametrize("balanced", BALANCED, ids=["balanced", "simple"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_blocks_cover_the_document_mask_once(world, balanced):
    """_doc_blocks of all ranks and steps, placed at their global positions (cp_positions: the layout the data is
    sharded with), cover the document mask exactly once, for random layouts; step 0 opens with the causal blocks,
    which cover each local row once (so every row is written before anything is merged into it), and no other step
    has one. No rank has a block after _last_step, and some rank has one there."""
    chunk = 4
    n, t = 2 * world * chunk, 2 * chunk
    gen = random.Random(world)
    lens_list = [(1,) * n, (chunk,) * (2 * world), (1, n - 2, 1)]
    for _ in range(30):
        lens = []
        while sum(lens) < n:
            lens.append(min(gen.randint(1, 3 * chunk), n - sum(lens)))
        lens_list.append(tuple(lens))
    for doc_lens in lens_list:
        covered = torch.zeros(n, n, dtype=torch.int64)
        layout = cp_layout(world, doc_lens, balanced)
        schedules = [DocumentSchedule(doc_lens, balanced, rank, world) for rank in range(world)]
        last = schedules[0].last
        for rank, sched in enumerate(schedules):
            steps = sched.steps
            assert len(steps) == world and not any(steps[last + 1:]) and sched.last == last
            q_pos = cp_positions(n, rank, world, layout)
            for i, blocks in enumerate(steps):
                k_pos = cp_positions(n, (rank - i) % world, world, layout)
                for rows, cols, causal in blocks:
                    qp, kp = q_pos[rows], k_pos[cols]
                    assert len(qp) and len(kp)
                    mask = sched.pieces if causal and sched.pieces else causal  # balanced: causal in each piece
                    covered[qp[:, None], kp[None, :]] += block_mask(len(qp), len(kp), mask)
            flags = [bool(causal) for _, _, causal in steps[0]]
            assert flags == sorted(flags, reverse=True) and not any(c for s in steps[1:] for _, _, c in s)
            rows = torch.cat([torch.arange(t)[r] for r, c, causal in steps[0] if causal])
            assert torch.equal(rows.sort().values, torch.arange(t)), doc_lens
        assert any(sched.steps[last] for sched in schedules)
        torch.testing.assert_close(covered, doc_mask(doc_lens).long(), msg=lambda m: f"{doc_lens}, cp {world}: {m}")


LEVERS = [dict(recompute=False), dict(recompute=True), dict(recompute=True, keep_attention=True),
          dict(offload=True, keep_attention=True, mlp_tile=5)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_window_matches_each_document_alone(dtype, group_of_one, tmp_path):
    """One process: the default attention (a mask in SDPA) and the ring of one, with each memory lever on and off,
    give the per-token NLL and gradients of each document run alone through transformers."""
    doc_lens = (5, 1, 9, 2, 6)  # 23 tokens: odd, so the ring of one takes the window as a single chunk
    m = tiny_model(dtype)
    ids, pos, labels = packed(doc_lens)
    ref_nll, ref_grads = alone_in_transformers(m, ids, labels, doc_lens, tmp_path)
    tol = 1e-5 if dtype == torch.float64 else 2e-4
    # between levers, rounding only: fp32 sums in another order differed by ~20 ulps in a norm weight's gradient
    # (2.1e-6 on an AMD EPYC's CPU kernels), so 1e-5 there, still 20x under the bound against the reference
    same = tol / 100 if dtype == torch.float64 else 1e-5
    first = None
    for attn_fn in (masked_attention, RingAttention(group_of_one, schedule=documents.schedule)):
        m.attn_fn = attn_fn
        for levers in LEVERS:
            nll, grads = nll_and_grads(m.set_levers(**levers), ids, pos, labels, doc_lens)
            torch.testing.assert_close(nll, ref_nll, atol=tol, rtol=tol, msg=lambda msg: f"{levers}: {msg}")
            assert_grads_close(grads, ref_grads, tol)
            first = first or (nll, grads)  # levers and attention functions change only rounding
            torch.testing.assert_close(nll, first[0], atol=same, rtol=same)
            assert_grads_close(grads, first[1], same)


def test_bad_documents_raise(group_of_one):
    q, kv = torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 6, 8)
    attn = RingAttention(group_of_one, schedule=documents.schedule)
    for doc_lens, msg in [((3, 2), "summing to the window's 6 tokens"), ((7, -1), "positive"), ((0, 6), "positive"),
                      ((), "got 0 lengths"), ((2.5, 3.5), "sequence of ints"), ("ab", "sequence of ints")]:
        for call in (lambda: attn(q, kv, kv, doc_lens), lambda: attn.fwd(q, kv, kv, doc_lens),
                     lambda: attn.bwd(q, q, kv, kv, q, q[..., 0], doc_lens)):
            with pytest.raises(ValueError, match=msg):
                call()
    with pytest.raises(ValueError, match="sum to 5, not to the 6 tokens"):
        masked_attention(q, kv, kv, (2, 3))
    m = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="needs position_ids"):
        m(torch.zeros(1, 6, dtype=torch.long), doc_lens=(2, 4))


# --- CUDA (skipped without a GPU) ---

GPU_DOCS = (1, 1200, 1300, 3, 696, 800)  # 4000 tokens: cp 2 cuts at 1000, 2000, 3000, and a document crosses each


def cuda_inputs(seed=0):
    """q, k, v, dout in bf16, [B, T, H, D] memory seen as [B, H, T, D], as the model passes them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1, 4000, 8, 128), (1, 4000, 2, 128), (1, 4000, 2, 128), (1, 4000, 8, 128)]
    return [torch.randn(s, generator=gen, device="cuda").bfloat16().transpose(1, 2) for s in shapes]


def cuda_oracle_and_floor(q, k, v, dout, backend):
    """The fp64 oracle, and per output the bf16 floor: the larger of the oracle's own bf16 rounding and the error
    of the kernel run on each document alone (one call each)."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = naive_doc_attention(*leaves, GPU_DOCS)
    ref = dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *torch.autograd.grad(out, leaves, dout.double()))))
    alone, start = {n: [] for n in ref}, 0
    for length in GPU_DOCS:
        d = slice(start, start + length)
        o, lse = kernels.attn_fwd(q[:, :, d], k[:, :, d], v[:, :, d], True, backend)
        grads = kernels.attn_bwd(dout[:, :, d], q[:, :, d], k[:, :, d], v[:, :, d], o, lse, True, backend=backend)
        for n, x in zip(ref, (o, *grads)):
            alone[n].append(x)
        start += length
    floor = {n: max(rel(ref[n].bfloat16(), ref[n]), rel(torch.cat(alone[n], 2), ref[n])) for n in ref}
    return ref, floor


def cuda_backends():
    return ["cudnn"] + ([] if kernels.fa4_unavailable() else ["fa4"])


@pytest.mark.gpu
def test_document_ring_of_one_on_cuda(group_of_one):
    q, k, v, dout = cuda_inputs()
    for backend, balanced in itertools.product(cuda_backends(), BALANCED):
        ref, floor = cuda_oracle_and_floor(q, k, v, dout, backend)
        attn = RingAttention(group_of_one, kernels.Kernels(backend), schedule_of(balanced))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attn(*leaves, GPU_DOCS)
        out.backward(dout)
        got = dict(out=out, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
        out2, lse2 = attn.fwd(q, k, v, GPU_DOCS)
        got2 = dict(zip(("dq", "dk", "dv"), attn.bwd(dout, q, k, v, out2, lse2, GPU_DOCS)), out=out2)
        for n in ref:
            assert got[n].dtype == torch.bfloat16 and rel(got[n], ref[n]) <= 3 * floor[n], (backend, balanced, n)
            assert rel(got2[n], ref[n]) <= 3 * floor[n], (backend, balanced, n)


def _cuda_rank_main(rank, world, port, out_dir):
    torch.cuda.set_device(rank)
    documents.MIN_CHUNK = 1  # as in the parent (fine_chunks)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for backend, balanced in itertools.product(cuda_backends(), BALANCED):
            layout = cp_layout(world, GPU_DOCS, balanced)
            q, k, v, dout = (cp_shard(x.transpose(1, 2), 1, rank, world, layout).transpose(1, 2)
                             for x in cuda_inputs())
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            out = RingAttention(dist.group.WORLD, kernels.Kernels(backend), schedule_of(balanced))(q, k, v, GPU_DOCS)
            out.backward(dout)
            results[backend, balanced] = {n: t.detach().cpu()
                                          for n, t in dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad).items()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_document_ring_cp2_over_nccl(tmp_path):
    mp.start_processes(_cuda_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    q, k, v, dout = cuda_inputs()
    for backend, balanced in itertools.product(cuda_backends(), BALANCED):
        ref, floor = cuda_oracle_and_floor(q, k, v, dout, backend)
        for n in ref:
            got = cp_unshard([r[backend, balanced][n] for r in ranks], 2, cp_layout(2, GPU_DOCS, balanced)).cuda()
            assert rel(got, ref[n]) <= 3 * floor[n], (backend, balanced, n, rel(got, ref[n]), floor[n])


def test_short_pieces_leave_cudnn(monkeypatch):
    """cuDNN's backward kills the process on a one-token piece (bench/results/short_pieces.json); a document mask
    makes such pieces, so pieces under CUDNN_MIN_TOKENS run on flash. The choice alone, on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    def piece(n):
        return torch.empty(1, 8, n, 128, device="meta")
    assert kernels._choose("cudnn", cuda, piece(1), piece(1)) == "flash"
    assert kernels._choose("cudnn", cuda, piece(700), piece(1)) == "flash"
    assert kernels._choose("cudnn", cuda, piece(kernels.CUDNN_MIN_TOKENS), piece(700)) == "cudnn"
    assert kernels._choose("cudnn", cuda) == "cudnn"
