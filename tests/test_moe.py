"""Qwen3-MoE (moe.py) against transformers' Qwen3MoeForCausalLM on the same weights: logits, loss (with the
load-balancing loss too, apart) and every parameter's gradient; the router against transformers' router,
ties included; HF checkpoints both ways; the memory levers on and off; the ring at cp 2 and 4 under gloo; the
grouped GEMM against the expert loop (torch's CPU fallback here; the CUDA kernel in the test marked gpu).
train.py end to end on a MoE config.json: tests/e2e/test_moe.py. CPU, about 40 s:

    python -m pytest tests/test_moe.py -q
"""
import functools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers  # a test dependency: the independent reference for the model
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from million import hf as H
from million import moe
from model import Qwen3Config
from million.moe import Qwen3MoE
from parallel import RingAttention, cp_shard
from test_fa4 import rel
from test_loss import LargestTensor
from test_model import group_of_one, levers_change_nothing, loss_and_grads  # noqa: F401 (a fixture)
from test_ring import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def moe_cfg(**kw):
    """3 layers, the middle one dense (mlp_only_layers); 5 heads over 1 KV head; vocab 97."""
    d = dict(vocab_size=97, hidden_size=40, intermediate_size=72, moe_intermediate_size=24,
             num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1, head_dim=8, rope_theta=10000.0,
             num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    d.update(kw)
    return H.config_from_dict({"model_type": "qwen3_moe", **d})


def random_moe(cfg, dtype=torch.float32, seed=0):
    """Weights from init_weights, norms away from 1, and the routers 10x larger: router logits of order 1, so
    that the top-k choice is far from a tie that rounding (ours vs transformers', or a ring's) could flip."""
    torch.manual_seed(seed)
    m = Qwen3MoE(cfg).to(dtype)
    m.init_weights()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if n.endswith("mlp.gate.weight"):
                p.mul_(10)
    return m


def shifted(ids):
    """Our labels: the next token, -100 at the end (transformers shifts its labels inside the loss)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)


def hf_grad(hf, name, cfg):
    """The gradient transformers holds for our parameter `name` (5.x fuses each layer's experts' gate and up
    projections into gate_up_proj [E, 2I, H], gate first)."""
    params = dict(hf.named_parameters())
    module, _, weight = name.rpartition(".")
    if not module.endswith("mlp.experts"):
        return params[H.hf_name(name)].grad
    if weight == "down_proj":
        return params[f"model.{module}.down_proj"].grad
    both = params[f"model.{module}.gate_up_proj"].grad
    return both[:, :cfg.moe_intermediate_size] if weight == "gate_proj" else both[:, cfg.moe_intermediate_size:]


def ours_and_transformers(m, ids, folder):
    """(our language-model loss and auxiliary loss / trained tokens (None without one), logits, grads of their sum)
    and transformers' (outputs.loss, logits, grads under our names, outputs.aux_loss), both in float32 on m's
    weights."""
    H.save_pretrained(m, str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    out = hf(ids, labels=ids)
    out.loss.backward()
    ref = (out.loss.detach(), out.logits.detach(), {n: hf_grad(hf, n, m.cfg) for n, _ in m.named_parameters()},
           out.aux_loss)
    m.zero_grad(set_to_none=True)
    out = m(ids, labels=shifted(ids), loss_chunk=9)
    n = out.n_valid
    (out.total() / n).backward()
    with torch.no_grad():
        logits = m.logits(ids)
    aux = None if out.aux_sum is None else (out.aux_sum / n).detach()
    return ((out.loss_sum / n).detach(), aux, logits, {k: p.grad.clone() for k, p in m.named_parameters()}), ref


# --- against transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("experts,k", [(4, 2), (5, 3)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("aux", [False, True], ids=["plain", "aux"])
def test_matches_transformers(tmp_path, experts, k, norm_topk_prob, aux):
    """Logits, loss and every gradient against Qwen3MoeForCausalLM in float32. With output_router_logits,
    transformers' outputs.loss = NLL + coef * aux (coef 0.1 here, so that aux moves the loss by ~5%): ours comes
    apart, the language-model loss as loss_sum and coef * aux as aux_sum, and the gradient is of their sum."""
    cfg = moe_cfg(num_experts=experts, num_experts_per_tok=k, norm_topk_prob=norm_topk_prob,
                  output_router_logits=aux, router_aux_loss_coef=0.1)
    m = random_moe(cfg)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    (loss, our_aux, logits, grads), (ref_loss, ref_logits, ref_grads, ref_aux) = ours_and_transformers(m, ids,
                                                                                                      tmp_path)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss + (our_aux if aux else 0), ref_loss, rtol=1e-6, atol=0)
    for n, g in ref_grads.items():  # the float32 floor: ~1e-7 measured
        assert rel(grads[n], g) < 1e-5, (n, rel(grads[n], g))
    if aux:  # the aux term is really there, and apart: our loss is transformers' less coef * aux
        assert ref_aux.item() > 1.0  # top-k of E: aux >= 1 (0 would mean it is not computed)
        torch.testing.assert_close(loss, ref_loss - 0.1 * ref_aux.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(our_aux, 0.1 * ref_aux.detach(), rtol=1e-5, atol=0)
    else:
        assert our_aux is None


def test_router_matches_transformers_ties_included():
    """route() against Qwen3MoeTopKRouter: the same experts, weights and dtype, where two experts' router rows
    are equal (an exact tie) and where a row of probabilities is uniform."""
    cfg = moe_cfg(num_experts=6, num_experts_per_tok=3)
    hf_cfg = transformers.Qwen3MoeConfig(**H.config_to_dict(cfg))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=gen)
    w[4] = w[1]  # experts 1 and 4 always tie
    x = torch.randn(31, 40, generator=gen)
    x[5] = 0  # every probability 1/6
    for norm in (True, False):
        hf_cfg.norm_topk_prob = norm
        router = Qwen3MoeTopKRouter(hf_cfg)
        with torch.no_grad():
            router.weight.copy_(w)
        _, ref_weights, ref_experts = router(x)
        probs, weights, experts = moe.route(x, w, 3, norm)
        assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
        assert ((experts == 1) | (experts == 4)).sum() > 0


@pytest.mark.parametrize("step,only", [(1, []), (1, [0, 3]), (2, []), (3, [2]), (1, [0, 1, 2, 3, 4])])
def test_sparse_layers_as_transformers_decides(step, only):
    cfg = moe_cfg(num_hidden_layers=5, decoder_sparse_step=step, mlp_only_layers=only)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**H.config_to_dict(cfg)))
    ours = Qwen3MoE(cfg)
    want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert [cfg.sparse(i) for i in range(5)] == want
    assert [isinstance(b.mlp, moe.SparseMoE) for b in ours.layers] == want


def test_config_round_trips_through_transformers(tmp_path):
    """Our config.json is transformers' Qwen3MoeConfig, and one transformers wrote (num_experts saved as
    num_local_experts) reads back as ours; the MoE fields survive both ways."""
    cfg = moe_cfg(num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                  mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.02)
    fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "output_router_logits", "router_aux_loss_coef")
    d = H.config_to_dict(cfg)
    assert d["model_type"] == "qwen3_moe" and d["architectures"] == ["Qwen3MoeForCausalLM"]
    hf_cfg = transformers.Qwen3MoeConfig(**d)
    hf_cfg.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in saved  # transformers' own spelling: read as num_experts
    again = H.read_config(str(tmp_path))
    for f in fields:
        assert getattr(again, f) == getattr(cfg, f) == getattr(hf_cfg, f), f
    assert "num_local_experts" not in H.config_to_dict(again) and H.config_to_dict(again)["num_experts"] == 5
    dense = Qwen3Config.tiny()
    assert getattr(dense, "num_experts", 0) == 0 and H.config_to_dict(dense)["model_type"] == "qwen3" and "num_experts" not in H.config_to_dict(dense)
    with pytest.raises(ValueError, match="num_experts >= num_experts_per_tok"):
        moe_cfg(num_experts=2, num_experts_per_tok=3)


def test_init_weights_draws_the_new_parameters():
    m = Qwen3MoE(moe_cfg(num_experts=16, moe_intermediate_size=48))
    m.init_weights(torch.Generator().manual_seed(0))
    for n, p in m.named_parameters():
        if "mlp.gate." in n or "mlp.experts." in n:
            assert p.std().item() == pytest.approx(0.02, rel=0.1), n


# --- HF checkpoints --------------------------------------------------------------------------------

def test_transformers_checkpoint_loads_in_ours(tmp_path):
    """A checkpoint transformers saved (its hub layout: one tensor per expert), read by hf.from_pretrained:
    the same logits; saved again by us, the same tensors under the same names, bit for bit."""
    cfg = moe_cfg(num_experts=5, num_experts_per_tok=2, norm_topk_prob=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**H.config_to_dict(cfg)))
    hf.save_pretrained(str(tmp_path / "hf"))
    m = H.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert isinstance(m, Qwen3MoE)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    H.save_pretrained(m, str(tmp_path / "ours"), max_shard_bytes=30_000)  # sharded: the index names every expert
    from safetensors.torch import load_file
    def tensors(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    theirs, ours = tensors(tmp_path / "hf"), tensors(tmp_path / "ours")
    assert theirs.keys() == ours.keys() and "model.layers.2.mlp.experts.4.down_proj.weight" in ours
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)


def test_our_checkpoint_loads_in_transformers(tmp_path):
    """Ours saved (bf16) -> transformers.AutoModelForCausalLM: Qwen3MoeForCausalLM with our logits; and back into
    ours, bit for bit."""
    m = random_moe(moe_cfg(norm_topk_prob=False), dtype=torch.bfloat16)
    H.save_pretrained(m, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    m32 = H.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m32.logits(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    back = H.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# --- the levers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("levers", [dict(recompute=True), dict(offload=True), dict(recompute=False, mlp_tile=7),
                                    dict(recompute=True, offload=True, mlp_tile=5),
                                    dict(recompute=True, keep_attention=True),
                                    dict(offload=True, keep_attention=True, mlp_tile=6)])
def test_levers_keep_loss_and_gradients(levers, group_of_one):
    """float64, with the load-balancing loss on (its gradient crosses the recomputed block and the tiles as a
    second output): each lever changes no loss and no gradient beyond rounding."""
    m = random_moe(moe_cfg(num_experts=5, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1),
                   dtype=torch.float64)
    m.attn_fn = RingAttention(group_of_one)  # fwd/bwd halves: keep_attention really skips the recompute
    levers_change_nothing(m, levers)
    assert all(b.mlp.tile == levers.get("mlp_tile", 0) for b in m.layers)


def test_tiled_moe_makes_no_tensor_of_the_whole_sequence():
    """Cost, not only values: untiled, an expert's activations are [rows it got, I] (~N*k/E rows); tiled, no
    tensor is larger than the block's own input [N, H] (its output, its input's gradient)."""
    N, H, I = 4000, 16, 64
    block = moe.SparseMoE(moe_cfg(hidden_size=H, moe_intermediate_size=I, output_router_logits=True))  # top-2 of 4
    x = torch.randn(1, N, H, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def largest(tile):
        block.tile = tile
        with LargestTensor() as seen:
            y, _, prob_sums = block.with_stats(x)
            (y.sum() + prob_sums.sum()).backward()
        return seen.numel
    assert largest(0) >= 0.8 * N * 2 // 4 * I and largest(100) == N * H, (largest(0), largest(100))


@pytest.mark.parametrize("frozen", ["experts", "router and experts"])
def test_tiled_moe_computes_no_gradient_for_frozen_weights(frozen):
    """Under LoRA the router and the experts are frozen. The tiled block's backward then skips the frozen weights'
    gradients: exactly their FLOPs less (FlopCounterMode: 2 x routed rows x 3 x H x I for the experts, 2 x N x H x E
    for the router), with the same input gradient and the same gradient for a router that still trains."""
    from torch.utils.flop_counter import FlopCounterMode
    N, H, I, E, k = 300, 16, 24, 4, 2
    block = moe.SparseMoE(moe_cfg(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k))
    block.tile = 70
    x = torch.randn(1, N, H, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def backward():
        x.grad = None
        block.zero_grad(set_to_none=True)
        y, _, prob_sums = block.with_stats(x)
        with FlopCounterMode(display=False) as fc:
            (y.square().sum() + prob_sums.sum()).backward()
        return fc.get_total_flops(), x.grad.clone(), block.gate.weight.grad
    trained, dx, d_router = backward()
    block.experts.requires_grad_(False)
    saved = 2 * N * k * 3 * H * I
    if frozen == "router and experts":
        block.gate.requires_grad_(False)
        saved += 2 * N * H * E
    left, dx_frozen, d_router_frozen = backward()
    assert all(p.grad is None for p in block.parameters() if not p.requires_grad)
    torch.testing.assert_close(dx_frozen, dx, rtol=0, atol=0)
    if frozen == "experts":
        torch.testing.assert_close(d_router_frozen, d_router, rtol=0, atol=0)
    assert trained - left == saved, (trained, left, saved)


# --- the ring: cp 2 and 4 under gloo -----------------------------------------------------------------

def cp_model():
    return random_moe(moe_cfg(num_experts=5, num_experts_per_tok=2, output_router_logits=True,
                              router_aux_loss_coef=0.1), dtype=torch.float64)


def cp_inputs():
    """One 40-token sequence (cp 4: chunks of 5), some labels ignored: the aux counts every token, the loss not."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, 40), generator=gen)
    labels = shifted(ids)
    labels[0, 7:12] = -100
    return ids, torch.arange(40)[None], labels


def _rank_main(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        m = cp_model().set_levers(recompute=True, keep_attention=True, mlp_tile=3)
        m.attn_fn = RingAttention(dist.group.WORLD)
        m.cp_sum = functools.partial(dist.all_reduce, group=dist.group.WORLD)
        ids, pos, labels = (cp_shard(x, 1, rank, world) for x in cp_inputs())
        out = m(ids, pos, labels, loss_chunk=4)
        out.total().backward()
        torch.save((out.loss_sum.detach(), out.aux_sum.detach(), {k: p.grad for k, p in m.named_parameters()}),
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_gives_one_process_losses_and_gradients(world, tmp_path):
    """The loss sums and gradients of cp 2 and 4 (ring attention, recompute with kept attention, tiled MoE, the
    router counts all-reduced) summed over the ranks equal one process's, load-balancing loss included, and so do
    the language-model and load-balancing sums apart."""
    ranks = run_ranks(world, tmp_path, main=_rank_main)
    m = cp_model()
    ids, pos, labels = cp_inputs()
    ref, grads = loss_and_grads(m, ids, labels)
    torch.testing.assert_close(sum(r[0] + r[1] for r in ranks), ref, rtol=1e-6, atol=0)  # loss sums are fp32
    for n, g in grads.items():
        assert rel(sum(r[2][n] for r in ranks), g) < 1e-6, n
    with torch.no_grad():
        one = m(ids, labels=labels, loss_chunk=16)
    torch.testing.assert_close(sum(r[0] for r in ranks), one.loss_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(sum(r[1] for r in ranks), one.aux_sum, rtol=1e-6, atol=0)
    # the aux term is large enough that a rank's share formed without the all-reduce shows
    assert (ref - one.loss_sum).item() > 1e-2


# --- the grouped GEMM ----------------------------------------------------------------------------

def expert_inputs(N, H, I, E, k, dtype, device, empty=3, seed=0):
    """Rows, a routing in which expert `empty` gets no token, and expert weights (std 1/sqrt(fan-in))."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, H, generator=gen, device=device, dtype=torch.float64)
    logits = torch.randn(N, E, generator=gen, device=device, dtype=torch.float64)
    logits[:, empty] = float("-inf")
    weights, experts = logits.softmax(-1).topk(k, -1)
    ws = [torch.randn(E, I, H, generator=gen, device=device, dtype=torch.float64) / H ** 0.5,
          torch.randn(E, I, H, generator=gen, device=device, dtype=torch.float64) / H ** 0.5,
          torch.randn(E, H, I, generator=gen, device=device, dtype=torch.float64) / I ** 0.5]
    dy = torch.randn(N, H, generator=gen, device=device, dtype=torch.float64)
    return [t.to(dtype) for t in (x, weights, *ws)], experts, dy.to(dtype)


def run_experts(fn, leaves, experts, dy):
    """-> [y, dx, dweights, dw_gate, dw_up, dw_down]."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(leaves[0], leaves[1], experts, *leaves[2:])
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


NAMES = ["y", "dx", "dweights", "dw_gate", "dw_up", "dw_down"]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_gemm_equals_the_loop_on_cpu():
    """The sort, offsets and un-permutation of experts_grouped, through torch's CPU fallback of _grouped_mm, in
    float32: 37 rows, top-2 of 5 experts, one expert with no rows."""
    leaves, experts, dy = expert_inputs(37, 16, 24, 5, 2, torch.float32, "cpu")
    assert not (experts == 3).any()
    loop = run_experts(moe.experts_loop, leaves, experts, dy)
    grouped = run_experts(moe.experts_grouped, leaves, experts, dy)
    for name, a, b in zip(NAMES, grouped, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert grouped[3][3].abs().max() == 0  # the empty expert's weights get no gradient


def test_the_row_permutations_backward_is_index_selects():
    """moe._Rows (a gather whose backward gathers and sums each row's k copies) against index_select under
    autograd, in float64, forward and backward: 37 tokens, top-3, 5 columns, each slot to a random expert; and
    the output's permutation back (k = 1)."""
    gen = torch.Generator().manual_seed(0)
    N, k, H = 37, 3, 5
    order = torch.randint(0, 7, (N * k,), generator=gen).argsort(stable=True)
    unsort = order.argsort()
    x = torch.randn(N, H, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(N * k, H, generator=gen, dtype=torch.float64)
    for src, back, kk, rows in ((order, unsort, k, x), (unsort, order, 1, x.detach().repeat(k, 1).requires_grad_())):
        want = rows.index_select(0, src // kk)
        got = moe._Rows.apply(rows, src, back, kk)
        assert torch.equal(got, want)
        (dwant,) = torch.autograd.grad(want, rows, dout)
        (dgot,) = torch.autograd.grad(got, rows, dout)
        torch.testing.assert_close(dgot, dwant, rtol=1e-12, atol=1e-12)


def expert_lora(E, H, I, r, dtype, device, seed=1):
    """Random adapters in PEFT's layout for stacked experts: gate_up's A [r E, H] and B [2 I, r E], down's
    A [r E, I] and B [H, r E]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((r * E, H), (2 * I, r * E), (r * E, I), (H, r * E))
    return [(torch.randn(sh, generator=gen, device=device, dtype=torch.float64) * 0.3).to(dtype) for sh in shapes]


def with_lora(fn, scaling):
    """fn with its adapters as trailing positional tensors, so that run_experts differentiates them."""
    return lambda x, w, experts, g, u, d, *ad: fn(x, w, experts, g, u, d, tuple(ad), scaling)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_expert_adapters_are_peft_s_deltas_and_the_grouped_gemm_runs_them():
    """LoRA on the routed experts, fp32 on the CPU, 37 rows, top-2 of 5 experts (one with no rows), rank 8: the
    loop with adapters equals the loop without them on the weights PEFT's layout says they stand for (expert e:
    W + s B[:, e::E] @ A[e r:(e+1) r], gate_up's rows gate then up), and the grouped GEMM equals the loop, the
    adapters' gradients included (the empty expert's slices get none)."""
    E, H, I, r, s = 5, 16, 24, 8, 0.5
    leaves, experts, dy = expert_inputs(37, H, I, E, 2, torch.float32, "cpu")
    ad = expert_lora(E, H, I, r, torch.float32, "cpu")
    x, weights, wg, wu, wd = leaves
    with torch.no_grad():
        a_gu, b_gu, a_d, b_d = ad
        delta = [s * b_gu[:, e::E] @ a_gu[e * r:(e + 1) * r] for e in range(E)]       # [2 I, H] each
        merged = (wg + torch.stack([d[:I] for d in delta]), wu + torch.stack([d[I:] for d in delta]),
                  wd + torch.stack([s * b_d[:, e::E] @ a_d[e * r:(e + 1) * r] for e in range(E)]))
        torch.testing.assert_close(moe.experts_loop(x, weights, experts, *leaves[2:], tuple(ad), s),
                                   moe.experts_loop(x, weights, experts, *merged), rtol=1e-5, atol=1e-5)
    loop = run_experts(with_lora(moe.experts_loop, s), leaves + ad, experts, dy)
    grouped = run_experts(with_lora(moe.experts_grouped, s), leaves + ad, experts, dy)
    for name, a, b in zip(NAMES + ADAPTER_NAMES, grouped, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert loop[6][3 * r:4 * r].abs().max() == 0 and loop[7][:, 3::E].abs().max() == 0  # expert 3: no rows


ADAPTER_NAMES = ["dA_gate_up", "dB_gate_up", "dA_down", "dB_down"]


@pytest.mark.gpu
def test_expert_adapters_on_cuda_in_bf16():
    """The CUDA grouped GEMM with rank-16 adapters on the experts (bf16) and the loop (bf16) against the float64
    loop, forward and backward, at 4099 rows, top-8 of 16 experts, one with no rows: the grouped path within 2x of
    the loop's error or of the bf16 floor, the adapters' gradients included."""
    E, H, I, r, s = 16, 256, 128, 16, 2.0
    leaves, experts, dy = expert_inputs(4099, H, I, E, 8, torch.float64, "cuda")
    ad = expert_lora(E, H, I, r, torch.float64, "cuda")
    ref = run_experts(with_lora(moe.experts_loop, s), leaves + ad, experts, dy)
    bf = [t.bfloat16() for t in leaves + ad]
    assert moe.grouped_gemm_ok(bf[0], bf[2], bf[5:])
    loop = run_experts(with_lora(moe.experts_loop, s), bf, experts, dy.bfloat16())
    grouped = run_experts(with_lora(moe.experts_grouped, s), bf, experts, dy.bfloat16())
    for name, g, lp, rf in zip(NAMES + ADAPTER_NAMES, grouped, loop, ref):
        floor = rel(rf.bfloat16(), rf)
        assert g.dtype == torch.bfloat16 and rel(g, rf) <= 2 * max(rel(lp, rf), floor), (name, rel(g, rf), floor)


@pytest.mark.gpu
def test_grouped_gemm_on_cuda_in_bf16():
    """The CUDA grouped GEMM (bf16) and the loop (bf16) against the float64 loop, forward and backward, at 997
    and 4099 rows (multiples of nothing), top-2 and top-8, one expert with no rows: the grouped path is within 2x
    of the loop's error or of the bf16 floor. Then the whole block on CUDA bf16 takes the grouped path."""
    for N, E, k in ((997, 8, 2), (4099, 16, 8)):
        leaves, experts, dy = expert_inputs(N, 256, 128, E, k, torch.float64, "cuda")
        ref = run_experts(moe.experts_loop, leaves, experts, dy)
        bf = [t.bfloat16() for t in leaves]
        assert moe.grouped_gemm_ok(bf[0], bf[2])
        loop = run_experts(moe.experts_loop, bf, experts, dy.bfloat16())
        grouped = run_experts(moe.experts_grouped, bf, experts, dy.bfloat16())
        for name, g, lp, r in zip(NAMES, grouped, loop, ref):
            assert g.dtype == torch.bfloat16, name
            floor = rel(r.bfloat16(), r)
            assert rel(g, r) <= 2 * max(rel(lp, r), floor), (N, name, rel(g, r), rel(lp, r), floor)
        assert grouped[3][3].abs().max() == 0
    cfg = moe_cfg(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                  output_router_logits=True)
    block = moe.SparseMoE(cfg).to("cuda", torch.bfloat16)
    calls = []
    grouped = moe.experts_grouped
    moe.experts_grouped = lambda *a: calls.append(1) or grouped(*a)
    try:
        x = torch.randn(1, 1001, 256, generator=torch.Generator("cuda").manual_seed(0), device="cuda",
                        dtype=torch.bfloat16)
        y, counts, _ = block.with_stats(x)
    finally:
        moe.experts_grouped = grouped
    assert calls and counts.sum().item() == 1001 * 2 and y.shape == (1, 1001, 256)


@pytest.mark.gpu
def test_nf4_experts_on_cuda_run_the_grouped_gemm_on_their_dequantized_weights():
    """QLoRA's routed experts on CUDA (lora.LoRAExperts with nf4, rank 16): the block in bf16 gives the output, dx
    and the adapters' gradients of the same block whose experts hold the dequantized weights as plain bf16
    tensors, bit for bit, whole and in tiles of 300 rows, through the grouped GEMM."""
    import copy
    pytest.importorskip("torchao")
    from million import lora
    cfg = moe_cfg(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    base = moe.SparseMoE(cfg).requires_grad_(False)
    q, d = copy.deepcopy(base), copy.deepcopy(base)
    q.experts, d.experts = lora.LoRAExperts(q.experts, 16, 32.0, nf4=True), lora.LoRAExperts(d.experts, 16, 32.0)
    with torch.no_grad():
        for n, p in q.experts.named_parameters():  # B random too, so that every adapter gradient is non-zero
            p.copy_(torch.randn_like(p) * 0.05)
            d.experts.get_parameter(n).copy_(p)
    q, d = lora.quantize(q.to("cuda", torch.bfloat16)), d.to("cuda", torch.bfloat16)
    with torch.no_grad():
        for n in lora.LoRAExperts.WEIGHTS:
            assert lora.is_nf4(getattr(q.experts, n))
            getattr(d.experts, n).copy_(q.experts.base(n))
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, 1001, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    assert moe.grouped_gemm_ok(x[0], q.experts.base("gate_proj"), q.experts.weights()[3:])
    for tile in (0, 300):
        out = []
        for m in (q, d):
            m.tile = tile
            xl = x.clone().requires_grad_()
            y = m(xl)
            y.backward(dy)
            out.append([y, xl.grad, *(m.experts.get_parameter(n).grad for n in lora.LoRAExperts.ADAPTERS)])
            m.zero_grad(set_to_none=True)
        assert len(out[0]) == 2 + 4 and all(torch.equal(a, b) for a, b in zip(*out)), tile


# --- plan.py ---------------------------------------------------------------------------------------------

def test_plan_counts_parameters_and_the_matmuls_that_run():
    """plan.Shape's stored parameters are the model's; its matmul FLOPs (router + top-k experts a token) are
    what a forward of the logits executes, counted by FlopCounterMode (attention's own left out); and the real
    Qwen3-30B-A3B has its published 30.5B parameters, 3.3B of them active."""
    from torch.utils.flop_counter import FlopCounterMode
    from million import plan
    cfg = moe_cfg(num_experts=6, num_experts_per_tok=3, mlp_only_layers=[1])
    m = random_moe(cfg)
    T = 29
    s = plan.Shape.of(cfg, T, 1, 1, 1)
    assert s.params == sum(p.numel() for p in m.parameters()) and s.sparse_layers == 2
    with FlopCounterMode(display=False) as fc:
        m.logits(torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0)))
    matmuls = sum(n for op, n in fc.get_flop_counts()["Global"].items() if "attention" not in str(op))
    assert matmuls == 2 * plan.matmul_params(s) * T, (matmuls, 2 * plan.matmul_params(s) * T)
    big = plan.Shape.of(H.read_config(os.path.join(ROOT, "bench/configs/qwen3-30b-a3b")), 1, 1, 1, 1)
    assert round(big.params / 1e9, 1) == 30.5 and 3.3e9 <= big.active_params < 3.4e9  # "3.3B activated"
