"""The FlashAttention-4 backend of kernels.py against fp64 math attention, alone and in the ring (one GPU,
and two GPUs over NCCL). Needs an sm90+ GPU with flash-attn-4 installed; skipped elsewhere:

    pytest -m gpu tests/test_fa4.py

The bf16 floor: q, k, v and dout are bf16, the oracle computes in fp64 from those same values, so a kernel's
error is its own arithmetic (bf16 P and dS in the matmuls) plus the rounding of its bf16 output. FA4 must stay
within 3x of the larger of two references that measure that floor at each shape: the oracle's own result
rounded to bf16, and cuDNN (PyTorch's kernel, the previous default).
"""
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from million import kernels
import parallel
from test_ring import _free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(kernels.fa4_unavailable() is not None,
                       reason=f"FlashAttention-4 unavailable: {kernels.fa4_unavailable()}"),
]

# (batch, q heads, kv heads, query length, key length, head_dim, causal); causal needs Tq == Tk (kernels.py)
CASES = [
    (2, 5, 5, 999, 999, 128, True),  # MHA, 5 heads, odd length
    (1, 8, 2, 777, 777, 64, True),  # GQA 4:1, head_dim 64
    (1, 16, 2, 513, 1531, 128, False),  # GQA 8:1, non-causal, Tq != Tk (a ring's off-diagonal block)
    (2, 32, 8, 1536, 3072, 128, False),  # Qwen3's 32 q / 8 kv heads, the ring's q T/2 x kv T block
    (1, 32, 8, 2048, 2048, 128, True),  # Qwen3's heads, the ring's diagonal block
]


def bthd(b, h, t, d, gen):
    """[B, T, H, D] memory seen as [B, H, T, D], as the model passes q, k, v (and dout, from o_proj)."""
    return torch.randn(b, t, h, d, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)


def make_inputs(case, seed=0):
    b, hq, hkv, tq, tk, d, _ = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return bthd(b, hq, tq, d, gen), bthd(b, hkv, tk, d, gen), bthd(b, hkv, tk, d, gen), bthd(b, hq, tq, d, gen)


def math_attention(q, k, v, causal):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> out, lse [B, Hq, Tq] (natural log): the full scores."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


def oracle(q, k, v, dout, causal):
    """fp64 out, lse and dq, dk, dv."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = math_attention(*leaves, causal)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])


def rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def kernel(q, k, v, dout, causal, backend):
    out, lse = kernels.attn_fwd(q, k, v, causal, backend)
    dq, dk, dv = kernels.attn_bwd(dout, q, k, v, out, lse, causal, backend=backend)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_h{}-{}_t{}x{}_d{}_{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_fa4_matches_math_attention_within_bf16_floor(case):
    q, k, v, dout = make_inputs(case)
    causal = case[6]
    ref = oracle(q, k, v, dout, causal)
    fa4 = kernel(q, k, v, dout, causal, "fa4")
    cudnn = kernel(q, k, v, dout, causal, "cudnn")
    for name in ("out", "dq", "dk", "dv"):
        got = fa4[name]
        assert got.shape == ref[name].shape and got.dtype == torch.bfloat16, name
        floor = max(rel(ref[name].to(torch.bfloat16), ref[name]), rel(cudnn[name], ref[name]))
        err = rel(got, ref[name])
        assert err <= 3 * floor, f"{name}: FA4 {err:.2e}, bf16 floor {floor:.2e}"
    # lse is fp32 from bf16 inputs: only the kernels' fp32 arithmetic (exp2, the running max) separates them
    assert fa4["lse"].shape == ref["lse"].shape and fa4["lse"].dtype == torch.float32
    err = (fa4["lse"].double() - ref["lse"]).abs().max().item()
    floor = max((cudnn["lse"].double() - ref["lse"]).abs().max().item(), 1e-5)
    assert err <= 3 * floor, f"lse: FA4 max abs {err:.2e}, cuDNN {floor:.2e}"


@pytest.mark.parametrize("heads_per_call", [1, 4, 8, 32])
def test_fa4_backward_over_head_groups(heads_per_call):
    """The backward in groups of heads (the peak-memory split) gives the one-call gradients: heads are independent,
    so only dQ's atomic accumulation order differs, and at 1 head a call the rounding of dK/dV, summed in fp32 over
    the 4 query heads of their K/V head."""
    case = (1, 32, 8, 1000, 1000, 128, True)
    q, k, v, dout = make_inputs(case, seed=1)
    out, lse = kernels.attn_fwd(q, k, v, True, "fa4")
    whole = kernels.attn_bwd(dout, q, k, v, out, lse, True, heads_per_call=32, backend="fa4")
    parts = kernels.attn_bwd(dout, q, k, v, out, lse, True, heads_per_call=heads_per_call, backend="fa4")
    for name, a, b in zip(("dq", "dk", "dv"), parts, whole):
        assert a.shape == b.shape, name
        assert rel(a, b.double()) < 1e-2, name


@pytest.fixture(scope="module")
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_ring_of_one_with_fa4_matches_the_whole_sequence(group_of_one):
    """cp 1: RingAttention with fa4, through autograd and through fwd/bwd (the keep-attention replay)."""
    case = (1, 32, 8, 2048, 2048, 128, True)
    q, k, v, dout = make_inputs(case, seed=2)
    ref = oracle(q, k, v, dout, True)
    floor = {n: rel(kernel(q, k, v, dout, True, "cudnn")[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    attn = parallel.RingAttention(group_of_one, kernels.Kernels("fa4"))
    assert attn.kernels.backend == "fa4"
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = attn(*leaves)
    out.backward(dout)
    got = dict(out=out, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    out2, lse2 = attn.fwd(q, k, v)
    got2 = dict(zip(("dq", "dk", "dv"), attn.bwd(dout, q, k, v, out2, lse2)), out=out2)
    for name in floor:
        assert rel(got[name], ref[name]) <= 3 * floor[name], name
        assert rel(got2[name], ref[name]) <= 3 * floor[name], name
    assert kernels.Kernels().backend == "fa4"  # auto prefers FA4 where it runs


# --- cp 2 over NCCL on two GPUs ---

RING_CASES = [
    (1, 32, 8, 4096, 4096, 128, True),  # Qwen3's heads, chunks of 1024
    (2, 8, 1, 1548, 1548, 64, True),  # GQA 8:1, batch 2, chunks of 387 (odd)
]


def _rank_main(rank, world, port, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = []
        for case in RING_CASES:
            q, k, v, dout = (x.transpose(1, 2) for x in make_inputs(case, seed=3))  # [B, T, H, D] memory
            q, k, v, dout = (parallel.cp_shard(x, 1, rank, world).transpose(1, 2) for x in (q, k, v, dout))
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            out = parallel.ring_attention(q, k, v, dist.group.WORLD, kernels.Kernels("fa4"))
            out.backward(dout)
            results.append({n: t.detach().cpu() for n, t in dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad).items()})
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ring_cp2_over_nccl_with_fa4_matches_the_whole_sequence(tmp_path):
    mp.start_processes(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, case in enumerate(RING_CASES):
        q, k, v, dout = make_inputs(case, seed=3)
        ref = oracle(q, k, v, dout, True)
        cudnn = kernel(q, k, v, dout, True, "cudnn")
        for name in ("out", "dq", "dk", "dv"):
            got = parallel.cp_unshard([r[i][name] for r in ranks], 2).cuda()
            floor = max(rel(ref[name].to(torch.bfloat16), ref[name]), rel(cudnn[name], ref[name]))
            assert rel(got, ref[name]) <= 3 * floor, f"{name}, case {case}: {rel(got, ref[name]):.2e} vs {floor:.2e}"
