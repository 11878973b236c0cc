"""model.py against oracles: RoPE/YaRN from the formulas in float64 and from transformers' own initialisation,
the fused kernels' formulas against float64 autograd, a naive Qwen3 forward, transformers' Qwen3ForCausalLM on
the same checkpoint, recompute/offload/tiled-MLP parity; hf.py's load/save. CPU only, seconds:

    python -m pytest tests/test_model.py -q
"""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
import transformers  # a test dependency (requirements.txt): the independent reference for RoPE and the model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from million import hf as H
import model as M
from model import Qwen3, Qwen3Config, rope_cos_sin, rope_inv_freq


def tiny(**kw):
    d = dict(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=5,
             num_key_value_heads=5, head_dim=8, rope_theta=10000.0)
    d.update(kw)
    return Qwen3Config.tiny(**d)


def random_model(cfg, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = Qwen3(cfg).to(dtype)
    m.init_weights()
    with torch.no_grad():  # norms away from 1 so that a missing norm weight would show
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


# --- RoPE / YaRN --------------------------------------------------------------------------------

def yarn_oracle(d, theta, s, L0, beta_fast=32.0, beta_slow=1.0):
    """YaRN (Peng et al. 2023, as implemented for Qwen): element by element in Python floats."""
    def dim_for_rotations(n):  # the rotary dimension whose wavelength fits n times into L0
        return d * math.log(L0 / (n * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(dim_for_rotations(beta_fast)), 0)
    high = min(math.ceil(dim_for_rotations(beta_slow)), d - 1)
    out = []
    for i in range(d // 2):
        extrap = 1.0 / theta ** (2 * i / d)
        gamma = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(extrap / s * gamma + extrap * (1 - gamma))
    return torch.tensor(out, dtype=torch.float64), 0.1 * math.log(s) + 1


@pytest.mark.parametrize("d,theta,s,L0", [(128, 1e6, 32.0, 32768), (16, 1e4, 4.0, 512), (64, 5e5, 8.0, 4096)])
def test_yarn_matches_formula(d, theta, s, L0):
    cfg = tiny(head_dim=d, rope_theta=theta).yarn_scaled(s, L0)
    inv, factor = rope_inv_freq(cfg)
    ref_inv, ref_factor = yarn_oracle(d, theta, s, L0)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-14, atol=0)
    assert factor == pytest.approx(ref_factor)
    # The paper's boundary behaviour: fast-turning frequencies kept, slow ones interpolated by s.
    base = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    fast, slow = L0 * base / (2 * math.pi) > 32, L0 * base / (2 * math.pi) < 1
    torch.testing.assert_close(inv[fast], base[fast])
    torch.testing.assert_close(inv[slow], base[slow] / s)
    assert fast.any() and slow.any()


@pytest.mark.parametrize("d,theta,s,L0,extra", [
    (128, 1e6, 32.0, 32768, {}),                                   # the 1M recipe (Qwen3 at 32 x 32K)
    (16, 1e4, 4.0, 512, {}),
    (64, 5e5, 8.0, 4096, dict(beta_fast=16.0, beta_slow=2.0)),
    (96, 1e6, 4.0, 32768, dict(beta_fast=64.0, beta_slow=0.5, attention_factor=1.3)),
])
def test_yarn_matches_transformers(d, theta, s, L0, extra):
    """The independent oracle: transformers' own YaRN initialisation on the same config.json dict."""
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": s, "original_max_position_embeddings": L0, **extra}
    cfg_dict = hf_config("new", head_dim=d, max_position_embeddings=int(s * L0), rope_parameters=rope)
    hf_cfg = transformers.Qwen3Config(**cfg_dict)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    inv, factor = rope_inv_freq(H.config_from_dict(cfg_dict))
    # transformers works in fp32: the exponent 2i/d rounded to fp32 (off by up to 2^-25) costs theta^(2i/d)
    # ln(theta) * 2^-25 <= 4.1e-7 relative at theta 1e6, plus a few fp32 ulps (1.2e-7) for pow and the
    # divisions; measured 3.4e-7 at d 96. A wrong ramp end moves some frequency by >= (1 - 1/s) / (high - low).
    assert ref_inv.dtype == torch.float32
    torch.testing.assert_close(inv, ref_inv.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)  # Python floats on both sides
    if "attention_factor" not in extra:  # and the oracle the naive model below uses agrees with transformers
        oracle_inv, oracle_factor = yarn_oracle(d, theta, s, L0, **extra)
        torch.testing.assert_close(oracle_inv, ref_inv.double(), rtol=1e-6, atol=0)
        assert oracle_factor == pytest.approx(ref_factor, rel=1e-12)
    # cos/sin (layout [ang, ang] and the attention factor) against transformers' rotary embedding, at
    # positions where its fp32 angles are good: error <= pos * ~6e-7 * factor, 3.4e-3 at 4095 (measured 3.6e-4)
    pos = torch.tensor([[0, 1, 2, 7, 100, 511, 1000, 4095]])
    ref_cos, ref_sin = Qwen3RotaryEmbedding(hf_cfg)(torch.zeros(1, 8, d), pos)
    cos, sin = rope_cos_sin(pos, inv, factor)
    torch.testing.assert_close(cos, ref_cos, atol=4e-3, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=4e-3, rtol=0)


def test_rope_cos_sin_at_a_million_positions():
    cfg = tiny(head_dim=128, rope_theta=1e6).yarn_scaled(32.0, 32768)
    pos = torch.tensor([[0, 1, 32767, 500_000, 1_048_575]])
    cos, sin = rope_cos_sin(pos, *rope_inv_freq(cfg))
    inv, factor = yarn_oracle(128, 1e6, 32.0, 32768)
    ang = torch.tensor([[p * f for f in inv.tolist()] for p in pos[0].tolist()], dtype=torch.float64)
    ang = torch.cat([ang, ang], -1)
    assert cos.dtype == torch.float32 and cos.shape == (1, 5, 128)
    torch.testing.assert_close(cos[0].double(), ang.cos() * factor, atol=2e-7, rtol=0)
    torch.testing.assert_close(sin[0].double(), ang.sin() * factor, atol=2e-7, rtol=0)


def test_default_rope_has_no_scaling():
    inv, factor = rope_inv_freq(tiny(head_dim=16, rope_theta=1e4))
    torch.testing.assert_close(inv, torch.tensor([1e4 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64))
    assert factor == 1.0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
def test_rmsnorm_matches_autograd_of_the_formula(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 37, generator=gen, dtype=dtype, requires_grad=True)
    w = (torch.rand(37, generator=gen, dtype=dtype) + 0.5).requires_grad_()
    dy = torch.randn(3, 7, 37, generator=gen, dtype=dtype)

    def formula(x, w):  # transformers' Qwen3RMSNorm
        h = x.to(torch.float32 if dtype != torch.float64 else dtype)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    ref = formula(x, w)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), dy)
    norm = M.RMSNorm(37, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    y = norm(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
    for a, b in ((y, ref), (dx, ref_dx), (dw, ref_dw)):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * max(1, b.abs().max().item()))
    # cost: only x (already alive) and one fp32 number per row are kept for backward
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    assert sum(t.numel() for t in saved if t.data_ptr() not in (x.data_ptr(), norm.weight.data_ptr())) == 3 * 7


def bf16_floor(ref):
    """Relative error of the float64 result rounded once to bf16: the best a bf16 output can do."""
    return ((ref.bfloat16().double() - ref).norm() / ref.norm()).item()


def test_silu_mul_backward_in_bf16_rounds_once():
    """The SwiGLU gradient kernel on bf16 inputs against autograd of silu(g) * u in float64. Computed in fp32
    and rounded once, its error is the bf16 floor (measured: 1.00x for dg and du); with g, u and sigmoid(g)
    left in bf16 it was 2.0x for dg and 1.2x for du."""
    gen = torch.Generator().manual_seed(0)
    shape = (3, 37, 53)
    g, u = ((torch.randn(shape, generator=gen, dtype=torch.float64) * 3).bfloat16() for _ in "gu")
    dh = torch.randn(shape, generator=gen, dtype=torch.float64).bfloat16()
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    ref = torch.autograd.grad(F.silu(g64) * u64, (g64, u64), dh.double())
    got = M._silu_mul_backward(dh, g, u)
    for name, a, b in zip(("dg", "du"), got, ref):
        assert a.dtype == torch.bfloat16 and a.shape == shape, name
        torch.testing.assert_close(a.double(), b, rtol=2**-8, atol=2**-8 * b.abs().max().item(), msg=name)
        err, floor = ((a.double() - b).norm() / b.norm()).item(), bf16_floor(b)
        assert err < 1.1 * floor, (name, err, floor)


# --- the model against a naive forward -------------------------------------------------------

def naive_forward(m, ids, pos, sd=None):
    """Qwen3 written out with explicit masks, repeated K/V and complex-number RoPE; sd: the weights (float64),
    by default m's."""
    cfg, sd = m.cfg, sd or {k: v.double() for k, v in m.state_dict().items()}
    inv, factor = yarn_oracle(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling["factor"],
                              cfg.rope_scaling["original_max_position_embeddings"]) if cfg.rope_scaling else \
        (torch.tensor([cfg.rope_theta ** (-2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)],
                      dtype=torch.float64), 1.0)
    rot = torch.polar(torch.full((len(pos), len(inv)), factor, dtype=torch.float64), pos[:, None].double() * inv)

    def rope(x):  # x (T, H, D): pairs (j, j + D/2) are the real and imaginary parts
        half = x.shape[-1] // 2
        z = torch.complex(x[..., :half], x[..., half:]) * rot[:, None, :]
        return torch.cat([z.real, z.imag], -1)

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    T, D, Hq, Hkv = len(ids), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x = sd["embed_tokens.weight"][ids]
    mask = pos[:, None] >= pos[None, :]
    for i in range(cfg.num_hidden_layers):
        p = lambda n: sd[f"layers.{i}.{n}.weight"]  # noqa: E731
        h = norm(x, p("input_layernorm"))
        q = rope(norm((h @ p("self_attn.q_proj").T).view(T, Hq, D), p("self_attn.q_norm")))
        k = rope(norm((h @ p("self_attn.k_proj").T).view(T, Hkv, D), p("self_attn.k_norm")))
        v = (h @ p("self_attn.v_proj").T).view(T, Hkv, D)
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = torch.einsum("hts,shd->thd", att, v).reshape(T, Hq * D)
        x = x + o @ p("self_attn.o_proj").T
        h = norm(x, p("post_attention_layernorm"))
        x = x + (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    x = norm(x, sd["norm.weight"])
    head = sd["embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("kv,yarn,tied", [(5, False, False), (1, True, True)])
def test_model_matches_naive_forward(kv, yarn, tied):
    cfg = tiny(num_key_value_heads=kv, tie_word_embeddings=tied)
    if yarn:
        cfg = cfg.yarn_scaled(4.0, 16)
    m = random_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(23)
    ref = torch.stack([naive_forward(m, ids[b], pos) for b in range(2)])
    torch.testing.assert_close(m.logits(ids), ref, rtol=1e-10, atol=1e-10)
    # Non-contiguous positions (as a zigzag shard has) change only the RoPE angles.
    zpos = torch.cat([torch.arange(0, 7), torch.arange(30, 37)])
    ref = torch.stack([naive_forward(m, ids[b, :14], zpos) for b in range(2)])
    torch.testing.assert_close(m.logits(ids[:, :14], zpos.expand(2, 14)), ref, rtol=1e-10, atol=1e-10)


def test_model_gradients_match_naive():
    """Every backward of ours (RoPE, RMSNorm, the tiled MLP's, the loss's) against autograd of the naive model."""
    cfg = tiny(num_attention_heads=6, num_key_value_heads=2).yarn_scaled(4.0, 16)
    m = random_model(cfg)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (1, 29), generator=gen)
    sd = {k: v.double().requires_grad_() for k, v in m.state_dict().items()}
    ref = F.cross_entropy(naive_forward(m, ids[0], torch.arange(29), sd), labels[0], reduction="sum")
    ref_grads = dict(zip(sd, torch.autograd.grad(ref, list(sd.values()))))
    for levers in (dict(recompute=False), dict(recompute=True, mlp_tile=8)):
        loss, grads = loss_and_grads(m.set_levers(**levers), ids, labels)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0)  # loss_sum is fp32
        for n, g in ref_grads.items():  # the loss's softmax runs in fp32 even for a float64 model: ~1e-8
            assert ((grads[n] - g).norm() / g.norm()).item() < 1e-6, n


def test_loss_inside_forward_equals_cross_entropy():
    m = random_model(tiny())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (1, 31), generator=gen)
    labels = torch.randint(0, 97, (1, 31), generator=gen)
    labels[0, :3] = -100
    s, n = m(ids, labels=labels, loss_chunk=8)
    ref = F.cross_entropy(m.logits(ids)[0], labels[0], reduction="sum", ignore_index=-100)
    torch.testing.assert_close(s.double(), ref, rtol=1e-6, atol=1e-6)
    assert int(n) == 28


# --- levers: same loss and gradients with each on and off -----------------------------------

def loss_and_grads(m, ids, labels):
    """(the loss the gradient is of: loss_sum, plus aux_sum where the model has one; every parameter's gradient)"""
    m.zero_grad(set_to_none=True)
    out = m(ids, labels=labels, loss_chunk=16)
    aux = getattr(out, "aux_sum", None)  # a MoE's load-balancing term (moe.MoENLL)
    total = out.loss_sum if aux is None else out.loss_sum + aux
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def levers_change_nothing(m, levers):
    """m (float64) on random tokens: the loss and every gradient with `levers` equal those without any lever."""
    gen = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 97, (2, 33), generator=gen), torch.randint(0, 97, (2, 33), generator=gen)
    ref_loss, ref_grads = loss_and_grads(m.set_levers(recompute=False), ids, labels)
    loss, grads = loss_and_grads(m.set_levers(**levers), ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.fixture(scope="module")
def group_of_one():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("levers", [dict(recompute=True), dict(offload=True), dict(mlp_tile=7),
                                    dict(recompute=True, offload=True, mlp_tile=5),
                                    dict(recompute=True, keep_attention=True),
                                    dict(offload=True, keep_attention=True, mlp_tile=6)])
def test_levers_keep_loss_and_gradients(levers, group_of_one):
    from parallel import RingAttention
    # float64, so that only a change of the math (not of summation order) could fail this; the attention
    # function with fwd/bwd halves (a ring of one) so that keep_attention really skips the recompute
    m = random_model(tiny(num_key_value_heads=1), dtype=torch.float64)
    m.attn_fn = RingAttention(group_of_one)
    levers_change_nothing(m, levers)
    if levers.get("offload"):  # per layer: the block input [2, 33, 40], and the attention out + lse if kept
        kept = 2 * 33 * 40 + (2 * 5 * 33 * 8 + 2 * 5 * 33 if levers.get("keep_attention") else 0)
        assert m.layers[0].offload.host_bytes() == 3 * kept * 8


def test_keep_attention_skips_the_attention_recompute(group_of_one):
    """Cost, not only values: with keep_attention the backward runs the attention forward kernel 0 times."""
    from parallel import RingAttention
    import parallel
    calls = []
    fwd = parallel._attn_fwd
    m = random_model(tiny(), dtype=torch.float64)
    m.attn_fn = RingAttention(group_of_one)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    for keep, expected in ((False, 2 * 3), (True, 3)):  # 3 layers: forward (+ recompute when not kept)
        calls.clear()
        parallel._attn_fwd = lambda *a: calls.append(1) or fwd(*a)
        try:
            m.set_levers(recompute=True, keep_attention=keep)
            s, _ = m(ids, labels=ids)
            s.backward()
        finally:
            parallel._attn_fwd = fwd
        assert len(calls) == expected, (keep, len(calls))


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_gathers_the_root_in_forward_only(tied, group_of_one):
    """parallel.shard_model: the root's embedding and head are sharded again from the end of the forward through
    the blocks' backward (their full copy is not held where the peak is), and the loss and every gradient
    (embedding, final norm and head included, which the root's post-backward reduces) are the unsharded model's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    import parallel
    cfg = tiny(tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 97, (1, 29), generator=gen), torch.randint(0, 97, (1, 29), generator=gen)
    ref_loss, ref_grads = loss_and_grads(random_model(cfg).set_levers(recompute=True), ids, labels)
    m = random_model(cfg).set_levers(recompute=True)
    parallel.shard_model(m, DeviceMesh.from_group(group_of_one, "cpu"), torch.float64, reduce_dtype=torch.float64)
    root = [m.embed_tokens] + ([] if tied else [m.lm_head])
    sharded = []  # per block backward: is each root weight the sharded DTensor (its full copy freed)?
    for b in m.layers:
        b.register_full_backward_pre_hook(lambda *_: sharded.append([isinstance(r.weight, DTensor) for r in root]))
    loss, grads = loss_and_grads(m, ids, labels)
    assert sharded == [[True] * len(root)] * cfg.num_hidden_layers
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g.full_tensor(), ref_grads[n], rtol=1e-12, atol=1e-12, msg=n)


def test_blocks_keep_one_cos_and_sin_under_fsdp(group_of_one):
    """FSDP2 casts each block's floating inputs to its compute dtype (bf16 here): cos and sin, made in that dtype,
    pass through uncopied, so the recomputed blocks all keep the same two tensors, not a pair each."""
    from torch.distributed.device_mesh import DeviceMesh
    import parallel
    m = random_model(tiny(), dtype=torch.float32).set_levers(recompute=True)
    parallel.shard_model(m, DeviceMesh.from_group(group_of_one, "cpu"), torch.bfloat16)
    ids = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(1))
    kept = []  # what the blocks save of the shape of cos and sin: [B, T, head_dim]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        m(ids, labels=ids, loss_chunk=16)
    kept = [t for t in kept if t.shape == (1, 32, 8)]
    assert len(kept) == 2 * m.cfg.num_hidden_layers and all(t.dtype == torch.bfloat16 for t in kept)
    assert len({t.data_ptr() for t in kept}) == 2


def test_checkpoint_keeps_only_block_inputs():
    """Saved-tensor bytes: with checkpointing the graph holds one [B, T, H] input per block (+ cos/sin)."""
    m = random_model(tiny(), dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(1))

    def saved_bytes(model):
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            model(ids).sum()
        return sum(total)
    full = saved_bytes(m.set_levers(recompute=False))
    ckpt = saved_bytes(m.set_levers(recompute=True))
    # checkpoint saves x (64x40 fp32) + cos + sin (64x8 fp32) per block; the final norm saves its own
    assert ckpt < full / 4, (ckpt, full)


def test_recomputed_block_frees_its_output_before_its_backward():
    """The recompute's output y (the residual add's, whose backward reads no value) holds no memory while the
    block's backward runs: its MLP's and attention's backward meet an empty storage."""
    m = random_model(tiny(), dtype=torch.float32).set_levers(recompute=True)
    blk, outs, sizes = m.layers[1], [], []
    body = blk.body
    blk.body = lambda *a, **kw: outs.append(body(*a, **kw)) or outs[-1]
    blk.mlp.register_full_backward_pre_hook(lambda *_: sizes.append(outs[-1].untyped_storage().size()))
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(1))
    m(ids, labels=ids, loss_chunk=16).loss_sum.backward()
    assert len(outs) == 2 and outs[0].untyped_storage().size() > 0  # the forward's output is the next block's input
    assert sizes == [0]


# --- HF checkpoints ---------------------------------------------------------------------------

def hf_config(style, **kw):
    d = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=97, hidden_size=40,
             intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu",
             attention_bias=False, use_sliding_window=False, sliding_window=None, torch_dtype="bfloat16")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    if style == "old":
        d.update(rope_theta=10000.0, rope_scaling=yarn)
    else:
        d.update(rope_parameters={**yarn, "rope_theta": 10000.0})
    d.update(kw)
    return d


def write_checkpoint(tmp_path, style, dtype=torch.bfloat16, shard_bytes=10**9, **kw):
    from safetensors.torch import save_file
    d = hf_config(style, **kw)
    cfg = H.config_from_dict(d)
    m = random_model(cfg, dtype=torch.float32)
    os.makedirs(tmp_path, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(d))
    save_file({H.hf_name(k): v.to(dtype).contiguous() for k, v in m.state_dict().items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return m


@pytest.mark.parametrize("style", ["old", "new"])
def test_load_both_config_styles(tmp_path, style):
    src = write_checkpoint(tmp_path, style)
    m = H.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert m.cfg.rope_theta == 10000.0
    assert m.cfg.rope_scaling["factor"] == 4.0 and m.cfg.rope_scaling["original_max_position_embeddings"] == 512
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v.to(torch.bfloat16)), k


@pytest.mark.parametrize("shard_bytes", [10**9, 20_000])
def test_save_load_round_trip_is_bit_exact(tmp_path, shard_bytes):
    write_checkpoint(tmp_path / "a", "new")
    m = H.from_pretrained(str(tmp_path / "a"), dtype=torch.bfloat16)
    H.save_pretrained(m, str(tmp_path / "b"), max_shard_bytes=shard_bytes)
    files = os.listdir(tmp_path / "b")
    assert ("model.safetensors.index.json" in files) == (shard_bytes < 10**9)
    m2 = H.from_pretrained(str(tmp_path / "b"), dtype=torch.bfloat16)
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    assert m2.cfg.rope_scaling == m.cfg.rope_scaling and m2.cfg.rope_theta == m.cfg.rope_theta


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    """The independent reference: transformers' own Qwen3 on our saved folder gives our logits."""
    write_checkpoint(tmp_path / "a", "old")
    m = H.from_pretrained(str(tmp_path / "a"), dtype=torch.float32)
    m.cfg = m.cfg.yarn_scaled(16.0, 256)  # a run's YaRN settings must travel with the weights
    H.save_pretrained(m, str(tmp_path / "b"))
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["rope_scaling"]["factor"] == 16.0 and saved["max_position_embeddings"] == 16 * 256  # consistent
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    # transformers forms RoPE angles in fp32; we form them in float64 (see rope_cos_sin)
    torch.testing.assert_close(m.logits(ids).detach(), ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kw,msg", [
    (dict(model_type="qwen2_moe"), "model_type"),
    (dict(use_sliding_window=True, sliding_window=4096), "sliding"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(num_experts=8), "mixture-of-experts"),
])
def test_refuses_configs_that_are_not_full_attention_qwen3(kw, msg):
    with pytest.raises(ValueError, match=msg):
        H.config_from_dict(hf_config("old", **kw))


def test_refuses_another_model_type_naming_what_is_supported(tmp_path):
    """A Llama config.json: one line that names the model type found and the ones supported."""
    d = hf_config("old", model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps({**d, "_name_or_path": "meta-llama/Llama-3.2-1B"}))
    with pytest.raises(ValueError) as e:
        H.read_config(str(tmp_path))
    msg = str(e.value)
    assert msg == ("meta-llama/Llama-3.2-1B: model_type 'llama' is not supported; supported: 'qwen3' (Qwen3), "
                   "'qwen3_moe' (Qwen3-MoE), 'qwen3_5' and 'qwen3_5_text' (Qwen3.5), 'qwen3_5_moe' and "
                   "'qwen3_5_moe_text' (Qwen3.5-MoE)."), msg


def test_a_moe_config_is_refused_by_the_dense_model():
    from million.moe import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**{**vars(Qwen3Config.tiny()), "num_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="moe.Qwen3MoE"):
        Qwen3(cfg)


def test_missing_files_and_weights_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        H.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        H.read_config(str(tmp_path))
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text(json.dumps(hf_config("old")))
    save_file({"model.embed_tokens.weight": torch.zeros(97, 40)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        H.from_pretrained(str(tmp_path))
    # a shard cut short (an interrupted download): the file is named, with what to do, not safetensors' own words
    with open(tmp_path / "model.safetensors", "r+b") as fh:
        fh.truncate(fh.seek(0, 2) // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read as safetensors \(SafetensorError: .*"
                                         r"Fetch the checkpoint again"):
        H.from_pretrained(str(tmp_path))


def test_config_only_folder_is_random_init_with_warning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config("new")))
    with pytest.warns(UserWarning, match="random initialisation"):
        m = H.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert m.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_hub_download_path(monkeypatch, tmp_path):
    import huggingface_hub
    write_checkpoint(tmp_path, "new")
    calls = []

    def fake_snapshot(repo_id, allow_patterns):  # stands in for the network only; loading is real
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    m = H.from_pretrained("Qwen/Qwen3-Tiny", dtype=torch.float32)
    assert calls[0][0] == "Qwen/Qwen3-Tiny" and "*.safetensors" in calls[0][1] and "config.json" in calls[0][1]
    assert m.cfg.vocab_size == 97

    def offline(repo_id, allow_patterns):
        raise huggingface_hub.errors.LocalEntryNotFoundError("connection refused")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConnectionError, match="could not download 'Qwen/Qwen3-Tiny'.*pass the local folder"):
        H.from_pretrained("Qwen/Qwen3-Tiny")


def test_host_offload_keeps_the_memory_layout():
    """A kept tensor in [B, T, H, D] memory seen as [B, H, T, D] comes back equal and in the same layout (the
    attention kernels then read it without a copy)."""
    off = M.HostOffload()
    x = torch.randn(2, 9, 4, 8, generator=torch.Generator().manual_seed(0)).transpose(1, 2)
    off.save((0, "out"), x)
    y = off.load((0, "out"), x.device)
    assert torch.equal(y, x) and y.stride() == x.stride()


def test_load_or_init_state_dict_reads_or_draws_from_the_seed(tmp_path):
    """A folder with weights gives them as saved; none (a tiny run) or a config-only folder gives init_weights'
    draw from the seed, in the dtype asked for: the draw train.py makes on every world size."""
    src = write_checkpoint(tmp_path / "a", "new")
    names = list(src.state_dict())
    sd = H.load_or_init_state_dict(str(tmp_path / "a"), src.cfg, names, torch.bfloat16, 0, "cpu")
    for k, v in src.state_dict().items():
        assert torch.equal(sd[k], v.to(torch.bfloat16)), k
    cfg = Qwen3Config.tiny(num_attention_heads=5, num_key_value_heads=1, head_dim=12, vocab_size=301)
    ref = Qwen3(cfg).to(torch.bfloat16)
    ref.init_weights(torch.Generator("cpu").manual_seed(7))
    drawn = H.load_or_init_state_dict(None, cfg, list(ref.state_dict()), torch.bfloat16, 7, "cpu")
    assert drawn.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert drawn[k].dtype == torch.bfloat16 and torch.equal(drawn[k], v), k
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(H.config_to_dict(cfg)))
    with pytest.warns(UserWarning, match="no \\*.safetensors: random initialisation"):
        m = H.from_pretrained(str(tmp_path / "b"), dtype=torch.bfloat16, seed=7)
    for k, v in ref.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    assert all(p.requires_grad and p.device.type == "cpu" for p in m.parameters())


@pytest.mark.parametrize("kind", ["qwen3", "qwen3 tied", "qwen3_5", "qwen3_5_moe"])
def test_a_draw_a_tensor_at_a_time_is_the_whole_models(kind):
    """hf.draw_to_host (a model too large to draw beside itself on its GPU) gives init_weights' numbers from the
    same seed, under every state-dict name (a tied model's too, which has no head of its own): tensor by tensor
    from the one generator."""
    from million.qwen3_5 import Qwen3_5Config, Qwen3_5MoeConfig
    cfg = {"qwen3": Qwen3Config.tiny(vocab_size=301), "qwen3 tied": Qwen3Config.tiny(tie_word_embeddings=True),
           "qwen3_5": Qwen3_5Config.tiny(), "qwen3_5_moe": Qwen3_5MoeConfig.tiny()}[kind]
    whole = H.load_or_init_state_dict(None, cfg, [], torch.bfloat16, 3, "cpu")
    with torch.device("meta"):
        ref = H.model_class(cfg)(cfg).to(torch.bfloat16)
    each = H.draw_to_host(ref, 3, "cpu")
    assert each.keys() == whole.keys() and len(whole) > 10
    for k, v in whole.items():
        assert each[k].device.type == "cpu" and each[k].dtype == v.dtype and torch.equal(each[k], v), k
    assert not torch.equal(each[next(iter(each))], H.draw_to_host(ref, 4, "cpu")[next(iter(each))])
