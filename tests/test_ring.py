"""Zigzag sharding and ring attention (parallel.py) against a naive fp64 oracle, on CPU under gloo.

    python -m pytest tests/test_ring.py -q

Each world size starts its ranks once; every rank shards the same full inputs, runs the ring forward and
backward for all CASES, and saves its shards; the parent gathers them and compares with the oracle.
"""
import math
import multiprocessing
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from million import kernels
import parallel
from parallel import ring_attention, cp_shard, cp_unshard

# (batch, q heads, kv heads, chunk length, head_dim); the total length is 2 * world * chunk
CASES = [
    (2, 5, 5, 7, 16),  # MHA with 5 heads, odd chunks
    (2, 8, 2, 7, 16),  # GQA 4:1
    (2, 8, 1, 3, 16),  # GQA 8:1
]


def naive_causal_attention(q, k, v):
    """q [B, Hq, L, D], k/v [B, Hkv, L, D]: the full [L x L] scores with an explicit mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def cp_positions(seq_len, rank, world, layout=None):
    """Global position ids [seq_len // world] of rank's tokens (in the window: the RoPE positions of one sequence)."""
    return cp_shard(torch.arange(seq_len), 0, rank, world, layout)


def make_inputs(case, world):
    b, hq, hkv, chunk, d = case
    seq = 2 * world * chunk
    gen = torch.Generator().manual_seed(1234)
    shapes = [(b, hq, seq, d), (b, hkv, seq, d), (b, hkv, seq, d), (b, hq, seq, d)]
    return [torch.randn(s, generator=gen) for s in shapes]  # q, k, v, grad_out


# --- the ranks ---

def _record_blocks(calls, module=parallel, names=("_attn_fwd", "_attn_bwd"), depth=None):
    """Wrap the kernel pair module.names so that each call's (kind, query rows, key rows, mask) is recorded (mask:
    the kernel's causal flag, or a block's pieces); a call made inside another recorded one is not, when the
    wrappers share `depth` (the per-piece calls of a pieces block without FA4). -> depth."""
    fwd, bwd = (getattr(module, name) for name in names)
    depth = [0] if depth is None else depth

    def recorded(kind, fn, q, k, mask, *args, **kwargs):
        if not depth[0]:
            calls.append((kind, q.shape[2], k.shape[2], mask))
        depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1

    def rec_fwd(q, k, v, mask, *args, **kwargs):
        return recorded("fwd", fwd, q, k, mask, q, k, v, mask, *args, **kwargs)

    def rec_bwd(dout, q, k, v, out, lse, mask, *args, **kwargs):
        return recorded("bwd", bwd, q, k, mask, dout, q, k, v, out, lse, mask, *args, **kwargs)

    for name, wrapper in zip(names, (rec_fwd, rec_bwd)):
        setattr(module, name, wrapper)
    return depth


def _rank_main(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results, calls = [], []
        _record_blocks(calls)
        for case in CASES:
            calls.clear()
            q, k, v, dout = (cp_shard(x, 2, rank, world) for x in make_inputs(case, world))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = ring_attention(q, k, v, dist.group.WORLD)
            out.backward(dout)
            results.append(dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, calls=list(calls)))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports, imported once by the fork server that starts the ranks (with the module of the first
# main run here): torch, and transformers' modeling code, which the test files import for their oracles
PRELOAD = ["torch", "torch.multiprocessing", "torch.distributed.fsdp", "torch.distributed.tensor",
           "transformers.modeling_utils"]


def run_ranks(world, out_dir, timeout=120, main=_rank_main):
    """Start world ranks of main(rank, world, port, out_dir) (a module-level function), each saving
    out_dir/rank{r}.pt; a failing rank fails the test with its traceback, a hung one with a timeout. The ranks are
    forked from a fork server that has done the imports (once for this process); a spawned rank would import torch
    and the modules under test again, seconds a rank on a busy CPU, more than most ranks' work."""
    multiprocessing.set_forkserver_preload(PRELOAD + [main.__module__])
    ctx = mp.start_processes(main, args=(world, _free_port(), str(out_dir)), nprocs=world,
                             join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(max(deadline - time.monotonic(), 0)):  # True once all ranks have exited
            if time.monotonic() >= deadline:
                pytest.fail(f"ranks of world {world} did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


# --- the tests ---

@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_matches_oracle(world, tmp_path):
    ranks = run_ranks(world, tmp_path)
    for i, case in enumerate(CASES):
        q, k, v, dout = (x.double().requires_grad_() for x in make_inputs(case, world))
        out = naive_causal_attention(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        want = dict(out=out, dq=dq, dk=dk, dv=dv)
        for name, ref in want.items():
            got = cp_unshard([r[i][name] for r in ranks], 2)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), ref.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}, case {case}, world {world}: {m}")

        # Equal work at every step of every rank: the same number of query-key pairs under the mask
        # (a causal square block counts half its area, as in the causal FLOP formula), world calls each way.
        b, hq, hkv, chunk, d = case
        t = 2 * chunk
        for kind in ("fwd", "bwd"):
            per_rank = [[c for c in r[i]["calls"] if c[0] == kind] for r in ranks]
            assert all(len(calls) == world for calls in per_rank)
            work = {tq * tk / (2 if causal else 1) for calls in per_rank for _, tq, tk, causal in calls}
            assert work == {t * t / 2}, (kind, per_rank)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_schedule_covers_causal_mask_once(world):
    """The blocks of all ranks and steps, placed at their global positions, tile the causal mask exactly."""
    chunk = 3
    seq, t = 2 * world * chunk, 2 * chunk
    covered = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(world):
        q_pos = cp_positions(seq, rank, world)
        for step in range(world):
            src = (rank - step) % world
            rows, cols, causal = parallel._visible_part(rank, src, t)
            qp, kp = q_pos[rows], cp_positions(seq, src, world)[cols]
            block = torch.ones(len(qp), len(kp), dtype=torch.int64)
            if causal:  # the kernels' causal mask: local query i sees local keys 0..i
                block = block.tril()
            covered[qp[:, None], kp[None, :]] += block
    torch.testing.assert_close(covered, torch.ones(seq, seq, dtype=torch.int64).tril())


@pytest.mark.parametrize("hkv,heads_per_call",
                         [(4, 1), (4, 2), (4, 3), (4, 6), (4, 9), (4, 12), (2, 4), (2, 5), (1, 5)])
def test_backward_over_head_groups_matches_oracle(hkv, heads_per_call):
    """_attn_bwd in groups of heads (one kernel call each) against autograd of the fp64 oracle: 12 query heads.
    Over 4 K/V heads (3 query heads each), 1/2/3/6/9/12 heads per call are 12/8/4/2/2/1 calls (9 rounds down to
    K/V heads dividing 4; 1 and 2 split each K/V head's three, 2 as 1 + 2, its dk/dv summed over them). Over 2
    (6 each), 4 and 5 heads a call are 2 calls of 3 a K/V head; over 1 (12), 5 are 3 calls of 4. No call takes
    more query heads than asked for. q/k/v/dout are [B, T, H, D] memory seen as [B, H, T, D], as the model
    passes them."""
    gen = torch.Generator().manual_seed(7)
    b, hq, t, d = 2, 12, 37, 16
    q, dout = (torch.randn(b, t, hq, d, generator=gen).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(b, t, hkv, d, generator=gen).transpose(1, 2) for _ in range(2))
    out, lse = parallel._attn_fwd(q, k, v, True)
    seen = []

    def call(*args):
        seen.append(args[1].shape[1])
        return parallel._attn_bwd_call(*args, causal=True)

    grads = parallel._by_head_groups(call, dout, q, k, v, out, lse, heads_per_call)
    assert max(seen) <= heads_per_call and sum(seen) == hq, seen
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    naive_causal_attention(*leaves).backward(dout.double())
    for name, got, leaf in zip("qkv", grads, leaves):
        assert got.shape == leaf.shape, name
        torch.testing.assert_close(got.double(), leaf.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_zigzag_round_trip_and_positions():
    x = torch.randn(3, 5, 84, 2, generator=torch.Generator().manual_seed(0))  # 84 = 2*cp * (42, 21, 14), cp 1, 2, 3
    for world in (1, 2, 3):
        shards = [cp_shard(x, 2, r, world) for r in range(world)]
        assert all(s.shape == (3, 5, 84 // world, 2) and s.is_contiguous() for s in shards)
        torch.testing.assert_close(cp_unshard(shards, 2), x, atol=0, rtol=0)
        for r in range(world):
            pos = cp_positions(x.shape[2], r, world)
            assert pos.dtype == torch.int64
            torch.testing.assert_close(pos, cp_shard(torch.arange(x.shape[2]), 0, r, world))
            torch.testing.assert_close(shards[r], x[:, :, pos], atol=0, rtol=0)
    # world 2, 8 tokens: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    # the contract's names: zigzag_shard(x, dim, rank, world) is chunks rank and 2*world-1-rank of 2*world
    chunks = x.chunk(6, 2)
    assert torch.equal(parallel.zigzag_shard(x, 2, 1, 3), torch.cat([chunks[1], chunks[4]], 2))
    assert torch.equal(parallel.zigzag_unshard([cp_shard(x, 2, r, 3) for r in range(3)], 2), x)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="divisible by 2\\*cp=8"):
        cp_shard(torch.zeros(1, 12), 1, 0, 4)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        cp_positions(10, 0, 2)
    q, kv = torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 6, 8)
    bad = {
        "must be even": (torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)),
        "multiple of key/value heads": (torch.zeros(1, 5, 6, 8), kv, kv),
        "differ in batch, length or head_dim": (q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)),
        "want q": (q, kv, torch.zeros(1, 2, 6, 4)),
        "dtype": (q, kv.double(), kv.double()),
    }
    for message, (q_, k_, v_) in bad.items():
        with pytest.raises(ValueError, match=message):
            ring_attention(q_, k_, v_, None)  # checked before the group is touched


def test_backend_choice_without_cuda(monkeypatch):
    """Without CUDA every backend runs the CPU kernels, and asking for fa4 says how to get it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kernels.fa4_unavailable.cache_clear()
    try:
        assert kernels.Kernels().backend == "cpu"
        assert kernels.Kernels(backend="cudnn").backend == "cpu"
        with pytest.raises(ValueError, match="pip install flash-attn-4.*--attn_backend cudnn"):
            kernels.Kernels(backend="fa4")
        with pytest.raises(ValueError, match="want one of auto, fa4, cudnn, flash"):
            kernels.Kernels(backend="sdpa")
    finally:
        kernels.fa4_unavailable.cache_clear()


def test_auto_takes_cudnn_where_it_was_measured_faster(monkeypatch):
    """auto takes FA4 where it runs, except head_dim 256 over whole sequences on an H100, where cuDNN's backward
    measured faster (bench/NOTES.md, "kernels.py"); on an H200, at head_dim 128, or with packed documents (FA4's
    one call per block of pieces), FA4. An explicit backend is never second-guessed. The run's line says why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "fa4_unavailable", lambda: None)
    for name, head_dim, packed, want in (("NVIDIA H100 80GB HBM3", 256, False, "cudnn"),
                                         ("NVIDIA H100 80GB HBM3", 256, True, "fa4"),
                                         ("NVIDIA H100 80GB HBM3", 128, False, "fa4"),
                                         ("NVIDIA H100 80GB HBM3", None, False, "fa4"),
                                         ("NVIDIA H200", 256, False, "fa4")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        k = kernels.Kernels("auto", head_dim, packed)
        assert k.backend == want, (name, head_dim, packed)
        assert kernels.Kernels("fa4", head_dim, packed).backend == "fa4"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    why = kernels.describe(kernels.Kernels("auto", 256), "auto")
    assert why == "cudnn (faster than fa4 at head_dim 256 on this GPU)"
    assert kernels.describe(kernels.Kernels("cudnn", 256), "cudnn") == "cudnn"


def test_a_run_on_text_packs_no_documents_and_takes_cudnn_on_an_h100(monkeypatch):
    """--packing auto on data known to be text (the synthetic corpus, PG-19 from its repo) packs no documents, so a
    Qwen3.5 run (head_dim 256) on an H100 takes cuDNN, in the run (train.py builds its Kernels with
    config.packs_documents) and in the plan that chose its levers (fit.plan_shape). Data that must be read to be
    judged (a local file, even a .txt; another hub repo), docs, or an --eval_data of documents keeps FA4."""
    import dataclasses

    from million import config, fit
    from model import Qwen3Config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "fa4_unavailable", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    mcfg = dataclasses.replace(Qwen3Config.tiny(), head_dim=256)
    for flags, packed in ((["--data", "synthetic"], False), (["--data", "pg19"], False),
                          (["--data", "synthetic:50", "--packing", "concat"], False), (["--data", "a.txt"], True),
                          (["--data", "pg19", "--data_repo", "me/books"], True),
                          (["--data", "rows.jsonl"], True), (["--data", "synthetic", "--packing", "docs"], True),
                          (["--data", "pg19", "--eval_data", "chats.parquet"], True)):
        cfg, _ = config.parse_args([*flags, "--device", "cpu"])
        assert config.packs_documents(cfg) == packed, flags
        want = "fa4" if packed else "cudnn"
        assert fit.plan_shape(cfg, mcfg, 1).attn_backend == want, flags


def test_only_cudnn_refusals_fall_back_to_flash():
    """An out-of-memory error (a RuntimeError too) or a CUDA error must surface, not be retried on flash."""
    assert kernels._cudnn_refused(RuntimeError("cuDNN Frontend error: No execution plans support the graph."))
    assert not kernels._cudnn_refused(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not kernels._cudnn_refused(RuntimeError("CUDA error: an illegal memory access was encountered"))
