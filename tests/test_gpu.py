"""The CUDA-only code paths (pinned-memory offload on a side stream, the cuDNN/flash kernels of the ring,
keep_attention with them) against the same model without them. Skipped without a GPU:

    pytest -m gpu tests
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import Qwen3, Qwen3Config
from parallel import RingAttention

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def grads(m, ids, **levers):
    m.set_levers(**levers)
    m.zero_grad(set_to_none=True)
    s, _ = m(ids, labels=ids)
    s.backward()
    torch.cuda.synchronize()
    return s.item(), {n: p.grad.float().clone() for n, p in m.named_parameters()}


def model(dtype, attn_fn=None):
    cfg = Qwen3Config.tiny(hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=64)
    torch.manual_seed(0)
    m = Qwen3(cfg).to("cuda", dtype)
    m.init_weights()
    if attn_fn is not None:
        m.attn_fn = attn_fn
    return m


def test_offload_on_a_side_stream_gives_the_same_gradients():
    m = model(torch.float32)
    ids = torch.randint(0, 257, (1, 4096), device="cuda")
    ref_loss, ref = grads(m, ids, checkpoint=True)
    for _ in range(2):  # the second step reuses the pinned buffers
        loss, got = grads(m, ids, offload=True, mlp_tile=1000)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_ring_of_one_matches_sdpa(group_of_one):
    q = torch.randn(1, 8, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    dout = torch.randn_like(q)
    out = RingAttention(group_of_one)(q, k, v)  # the cuDNN kernel (flash where cuDNN refuses)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout.float())
    for a, b in ((out, ref_out), *zip(got, ref)):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_keep_attention_on_cuda_gives_the_same_gradients(group_of_one):
    m = model(torch.bfloat16, RingAttention(group_of_one))
    ids = torch.randint(0, 257, (1, 4096), device="cuda")
    ref_loss, ref = grads(m, ids, checkpoint=True)
    loss, got = grads(m, ids, offload=True, keep_attention=True)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for n in ref:  # the same kernels on the same inputs: equal up to bf16 rounding of the summation order
        assert ((got[n] - ref[n]).norm() / ref[n].norm()).item() < 2e-2, n
