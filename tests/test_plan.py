"""plan.py: the cost model against the runs it was fitted to (bench/fit_plan.py), the FLOPs MFU counts against a
hand count and torch's FLOP counter, the planner against a brute-force search under the same model, the pinned-host
figure against what HostOffload really holds. --fit auto in train.py itself: tests/e2e/test_plan.py."""
import ast
import itertools
import mmap
import os
import re
import sys

import pytest
from dataclasses import replace
import torch
from torch.utils.flop_counter import FlopCounterMode

from million import hf
from million import plan
from model import Qwen3, Qwen3Config, pinned_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import fit_plan  # noqa: E402
GB = 1e9 / 2**30  # GiB per GB


def shape(name="qwen3-8b", seq_len=1_048_576, cp=8, world=8, per_node=8, param_bytes=4):
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", name))
    return plan.Shape.of(mcfg, seq_len, cp, world, per_node, param_bytes=param_bytes)


def test_the_constants_are_the_fit_of_the_measured_runs():
    """plan.FITTED is what bench/fit_plan.py fits to bench/results (not stale), and it predicts every run within 7%
    in time and 6% in GPU memory."""
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()) as out:
        errs = fit_plan.fit()
    fitted = {name: ast.literal_eval(value) for name, value in
              (line.split(" = ") for line in out.getvalue().splitlines())}
    for name, value in fitted.items():
        assert value == pytest.approx(getattr(plan.FITTED, name), rel=2e-3), name
    assert len(errs) == 20 and sum(" fa4 " in name for name, _, _ in errs) == 5
    for name, dt, dm in errs:
        assert abs(dt) < 0.07 and abs(dm) < 0.06, (name, dt, dm)


def test_out_of_sample_errors():
    """Each run predicted by constants fitted without it, and the runs no fit has seen (packed documents and a
    Qwen3-MoE among them): time within 10% (but the one-step 524k run, whose only step includes pinning 109 GiB of
    host memory), GPU memory within 6%."""
    errs = fit_plan.check()
    assert len(errs) == 28
    for name, dt, dm in errs:
        assert abs(dm) < 0.06, (name, dm)
        assert abs(dt) < (0.12 if "524288" in name else 0.10), (name, dt)


def test_useful_flops_are_a_hand_count():
    """What MFU counts, against a count written out here: per token, 6 FLOPs per parameter of q, k, v, o, the MLP
    and the head (no embedding lookup, no norms); causal attention 3 x 2 matmuls x 2 FLOPs x L^2/2 x 4096 per layer."""
    h, qd, kvd, inter, vocab, layers = 4096, 32 * 128, 8 * 128, 12288, 151936, 36
    for seq_len, cp in ((1_048_576, 8), (262_144, 2), (8_190, 1)):
        per_token = layers * (h * qd + h * kvd + h * kvd + qd * h + 3 * h * inter) + h * vocab
        attention = 3 * layers * 2 * 2 * qd * seq_len ** 2 / 2
        assert plan.useful_flops(shape(seq_len=seq_len, cp=cp, world=cp)) == pytest.approx(
            6 * per_token * seq_len + attention, rel=1e-15)
    assert plan.useful_flops(shape()) == pytest.approx(1.0204e18, rel=1e-4)  # attention is 95% of it


def test_useful_matmul_flops_are_what_torch_counts():
    """The matmul part of useful_flops is FlopCounterMode's count of a forward + backward with the full logits, on a
    tiny model of awkward sizes (5 query heads, 1 K/V head, vocabulary 301, 46 tokens). Attention is not in torch's
    count on CPU; the hand count above checks it."""
    cfg = Qwen3Config.tiny(num_attention_heads=5, num_key_value_heads=1, head_dim=12, vocab_size=301,
                           num_hidden_layers=3)
    m = Qwen3(cfg)
    m.init_weights(torch.Generator().manual_seed(0))
    ids = torch.randint(0, cfg.vocab_size, (1, 46))
    with FlopCounterMode(display=False) as counter:
        m.logits(ids).sum().backward()
    s = plan.Shape.of(cfg, 46, 1, 1, 1)
    assert counter.get_total_flops() == plan.useful_flops(s) - 3 * plan.attention_fwd_flops(s)


def test_the_cost_model_takes_its_constants_as_a_value():
    """Constants passed in are the ones used; plan.FITTED stays as it was."""
    s, lv = shape(), plan.Levers(20, 36)
    twice = plan.Constants({b: 2 * r for b, r in plan.FITTED.attn_tflops.items()}, 2 * plan.FITTED.gemm_tflops, 0.0,
                           plan.FITTED.work_bytes_per_token_hidden, plan.FITTED.ring_bytes_per_token_qdim)
    base = plan.predict(s, lv)
    faster = plan.predict(s, lv, twice)
    other = plan.FITTED.other_s_per_mtoken_layer * s.layers * s.tokens / 1e6
    assert faster.step_s == pytest.approx((base.step_s - other) / 2, rel=1e-12)
    assert faster.gpu_gib == base.gpu_gib and plan.predict(s, lv) == base


def test_the_chosen_plan_has_the_lowest_peak_of_the_nearly_fastest():
    """Against every (offload_layers, keep_attention_layers) pair under the same model, on nodes from roomy to too
    small: the plan is within TIME_SLACK of the fastest that fits; no plan that fits and is that fast has a lower
    GPU peak; of equal peaks it is the fastest, then the one pinning the least host memory. When the plan says
    nothing fits, nothing does."""
    s = shape()
    chosen = 0
    for gpu, host in ((74.5, 1907), (131, 560), (74.5, 512 * GB), (50, 600), (74.5, 250), (60, 200), (40, 600)):
        fits = []
        for off, keep in itertools.product(range(s.layers + 1), repeat=2):
            c = plan.predict(s, plan.Levers(off, keep))
            if c.gpu_gib <= plan.GPU_MARGIN * gpu and c.host_gib * s.ranks_per_node <= plan.HOST_MARGIN * host:
                fits.append(c)
        try:
            lv, cost = plan.choose(s, gpu, host)
        except plan.NoFit:
            assert not fits, (gpu, host)
            continue
        chosen += 1
        fastest = min(c.step_s for c in fits)
        assert cost.step_s <= fastest * (1 + plan.TIME_SLACK), (gpu, host)
        near = [c for c in fits if c.step_s <= fastest * (1 + plan.TIME_SLACK)]
        assert cost == min(near, key=lambda c: (c.gpu_gib, c.step_s, c.host_gib)), (gpu, host)
    assert chosen >= 5


def test_free_headroom_is_taken():
    """Qwen3-8B, 262,144 tokens, cp 2 on two H200s: keeping every block's tensors on the GPU is no faster than
    offloading most of them (offload is overlapped), so the plan keeps the GPU's peak far below its limit."""
    s = shape(seq_len=262144, cp=2, world=2, per_node=2)
    lv, cost = plan.choose(s, 139.8, 1000)
    # the fastest plan that offloads the fewest blocks (the rule before): 7 blocks, 125.8 GiB measured
    least = next(plan.predict(s, plan.Levers(off, s.layers)) for off in range(s.layers + 1)
                 if plan.predict(s, plan.Levers(off, s.layers)).gpu_gib <= plan.GPU_MARGIN * 139.8)
    assert cost.step_s <= least.step_s * (1 + plan.TIME_SLACK) and cost.gpu_gib < least.gpu_gib - 30


@pytest.mark.parametrize("gpu_gib,host_gib", [(80 * GB, 2000 * GB), (141 * GB, 560), (80 * GB, 512 * GB)])
def test_the_headline_command_gets_a_plan_on_common_nodes(gpu_gib, host_gib):
    """Qwen3-8B, 1,048,576 tokens, 8 GPUs, fp32 master weights: 8x80 GB + 2 TB, 8x141 GB + 560 GiB, 8x80 GB +
    512 GB. The old defaults (offload and keep everything) need 580.5 GiB of pinned memory per node."""
    s = shape()
    old = plan.predict(s, plan.Levers(s.layers, s.layers))
    assert old.host_gib * 8 == pytest.approx(580.5, abs=0.1)  # what made the default command stop before
    lv, cost = plan.choose(s, gpu_gib, host_gib)
    assert cost.host_gib * 8 <= 0.9 * host_gib and cost.gpu_gib <= 0.92 * gpu_gib
    fastest = plan.predict(s, plan.Levers(0, s.layers))  # keeps attention everywhere; offload costs no time
    assert cost.step_s <= fastest.step_s * (1 + plan.TIME_SLACK)  # so every node here runs at full speed


def test_levers_the_user_sets_win_and_no_fit_names_what_would():
    s = shape()
    lv, _ = plan.choose(s, 74.5, 1907, fixed={"keep_attention_layers": 0, "tiled_mlp": True, "mlp_tile": 8192})
    assert lv.keep_attention_layers == 0 and lv.mlp_tile == 8192
    with pytest.raises(plan.NoFit, match=r"nearest .*needs .* GiB of GPU memory.*--cp 16"):
        plan.choose(s, 36, 2000)  # 8 GPUs of 36 GiB: the state alone is 15 GiB, the kept tensors the rest
    with pytest.raises(plan.NoFit, match=r"GiB of host memory per node \(limit 7 of 8\)"):
        plan.choose(s, 60, 8)  # no room on the GPU for every block's input, none on the host for any


def test_pinned_host_bytes_are_what_host_offload_holds():
    """plan.host_bytes is exact: a tiny model with 2 of 3 blocks offloaded and 1 keeping attention."""
    from parallel import RingAttention
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = Qwen3Config.tiny(num_hidden_layers=3)
        m = Qwen3(cfg, RingAttention(dist.group.WORLD)).set_levers(offload=True, offload_layers=2,
                                                                    keep_attention=True, keep_attention_layers=1)
        m.init_weights(torch.Generator().manual_seed(0))
        ids = torch.randint(0, 257, (1, 40))
        s, _ = m(ids, labels=ids)
        s.backward()
        shp = plan.Shape.of(cfg, 40, 1, 1, 1, act_bytes=4)
        assert m.layers[0].offload.host_bytes() == plan.host_bytes(shp, plan.Levers(2, 1), pinned=False)
        assert [b.keep_attention for b in m.layers] == [True, False, False]
        # pinned (on a GPU), each buffer takes whole pages: 40 x 64 x 4 bytes -> 3 pages of 4 KiB, the lse 1
        page = mmap.PAGESIZE
        assert plan.host_bytes(shp, plan.Levers(2, 1)) == 2 * -(-10240 // page) * page + (
            -(-10240 // page) * page + -(-640 // page) * page)
    finally:
        dist.destroy_process_group()


def test_pinned_sizes_are_exact_to_the_page():
    """HostOffload pins each buffer in whole pages (cudaHostRegister), not at torch's power of two: Qwen3-4B's
    131k-token block input (0.625 GiB) takes 0.625 GiB, not 1; Qwen3-8B's (1 GiB), its attention output (1 GiB)
    and lse (16 MiB) lose nothing either way."""
    page = mmap.PAGESIZE
    assert [pinned_size(n) for n in (1, page - 1, page, page + 1, 3 * page)] == [page, page, page, 2 * page,
                                                                                 3 * page]
    s4 = shape("qwen3-4b", 131072, 1, 1, 1)
    assert plan.host_bytes(s4, plan.Levers(36, 36)) == 36 * (0.625 * 2**30 + 2**30 + 2**24)
    assert plan.host_bytes(s4, plan.Levers(36, 36), pinned=False) == 36 * (0.625 * 2**30 + 2**30 + 2**24)
    s8 = shape()  # 8B, 1M tokens, cp 8: 131,072 tokens per rank
    assert plan.host_bytes(s8, plan.Levers(36, 36)) == plan.host_bytes(s8, plan.Levers(36, 36), pinned=False)


def test_the_cost_model_keeps_attention_where_it_buys_time():
    """Time falls with every block that keeps attention, and host memory rises by exactly its kept tensors."""
    s = shape()
    costs = [plan.predict(s, plan.Levers(s.layers, k)) for k in range(s.layers + 1)]
    assert all(a.step_s > b.step_s for a, b in zip(costs, costs[1:]))
    _, out, lse = plan.kept_bytes(s)
    attn = out + lse
    assert costs[1].host_gib - costs[0].host_gib == pytest.approx(attn / 2**30)


# --- LoRA and QLoRA ---------------------------------------------------------------------------------------

def test_lora_counts_are_the_models():
    """The adapters plan.py counts are those lora.apply makes (Qwen3-8B, all seven projections at rank 16: the
    43,646,976 PEFT reports for it; q and v alone), and the NF4 share is every block projection (and, in a MoE,
    every expert)."""
    from million import lora
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3-8b"))
    for targets in (lora.TARGETS, ("q_proj", "v_proj")):
        with torch.device("meta"):
            m = lora.apply(Qwen3(mcfg), 16, targets=targets)
        s = plan.Shape.of(mcfg, 131072, 1, 1, 1, lora_rank=16, lora_targets=targets, quantize="nf4")
        assert s.lora_params == s.trained_params == sum(p.numel() for p in m.parameters() if p.requires_grad)
        assert s.nf4_params == sum(m.weight.numel() for m in m.modules() if isinstance(m, lora.LoRALinear))
        assert s.params == sum(p.numel() for p in m.parameters()) - s.lora_params
    assert plan.Shape.of(mcfg, 131072, 1, 1, 1, lora_rank=16, lora_targets=lora.TARGETS).lora_params == 43_646_976
    for name in ("qwen3-30b-a3b", "qwen3_5-35b-a3b"):  # QLoRA: the routed experts (and shared ones) in NF4 too
        mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", name))
        s = plan.Shape.of(mcfg, 131072, 1, 1, 1).lora_shape(16, "nf4")
        with torch.device("meta"):
            m = lora.apply(hf.model_class(mcfg)(mcfg), 16, targets=s.lora_targets, quantize="nf4")
        nf4 = [b for x in m.modules() if isinstance(x, (lora.LoRALinear, lora.LoRAExperts)) for b in x.buffers(False)]
        assert s.nf4_params == sum(b.numel() for b in nf4) and s.routed_params > 0.9 * s.nf4_params


def test_nf4_bytes_are_torchaos():
    """NF4_BYTES per parameter is what torchao's NF4Tensor holds for a bf16 weight: 4-bit codes, an int8 absmax
    per 64 weights, a bf16 factor per 256 absmaxes (and one mean)."""
    from million import lora
    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0)).bfloat16()
    q = lora.nf4(w)
    held = sum(t.numel() * t.element_size() for t in (q.quantized_data, q.quantized_scalers, q.quantization_factor))
    assert held / w.numel() == pytest.approx(plan.NF4_BYTES, rel=1e-12)


def test_lora_matmul_flops_are_what_torch_counts():
    """gemm_flops with LoRA is FlopCounterMode's count of a recomputed training step (chunked loss, frozen head):
    the frozen weights' forward, recompute and dX GEMMs, the head's forward and dH, the adapters' four passes."""
    from million import lora
    cfg = Qwen3Config.tiny(num_attention_heads=5, num_key_value_heads=1, head_dim=12, vocab_size=301)
    m = Qwen3(cfg)
    m.init_weights(torch.Generator().manual_seed(0))
    targets = ("q_proj", "o_proj", "up_proj", "down_proj")
    lora.apply(m, 3, targets=targets).set_levers(recompute=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 46), generator=torch.Generator().manual_seed(1))
    # torch counts no FLOPs for the in-place addmm_ that adds each adapter's product: given here as addmm's
    inplace = {torch.ops.aten.addmm_: lambda c, a, b, out_shape=None, **kw: 2 * a[0] * a[1] * b[1]}
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        s, _ = m(ids, labels=ids, loss_chunk=16)
        s.backward()
    shp = plan.Shape.of(cfg, 46, 1, 1, 1, lora_rank=3, lora_targets=targets)
    assert counter.get_total_flops() == plan.gemm_flops(shp)
    assert plan.gemm_flops(shp) < 0.8 * plan.gemm_flops(plan.Shape.of(cfg, 46, 1, 1, 1))
    counts = []  # tiled (the down projection's forward is not run again), then the last block keeping gate and up
    for kept in (0, 1):
        lora.keep_mlp(m.set_levers(recompute=True, mlp_tile=16), kept)
        with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
            s, _ = m(ids, labels=ids, loss_chunk=16)
            s.backward()
        counts.append(counter.get_total_flops())
    assert counts[0] - counts[1] == plan.gemm_flops(shp) - plan.gemm_flops(shp, plan.Levers(0, 0, keep_mlp_layers=1))


def test_lora_spends_the_gpu_memory_left_on_kept_mlp_outputs():
    """--fit auto with LoRA: the plan that would be chosen without the lever, then as many blocks keeping gate's
    and up's outputs as fit beside the two offloaded blocks in flight, where that saves more than TIME_SLACK;
    none where memory is tight or the saving small, none for a full fine-tune, and the command line's count
    wins."""
    cfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3-8b"))
    s = plan.Shape.of(cfg, 131072, 1, 1, 1, attn_backend="fa4").lora_shape()
    lv, cost = plan.choose(s, 139.2, 126)
    x, out, lse = plan.kept_bytes(s)
    cap, pair = plan.GPU_MARGIN * 139.2 * 2**30, 2 * (x + out + lse)
    assert (lv.offload_layers, lv.keep_attention_layers) == (36, 36) and 10 <= lv.keep_mlp_layers < 36
    one_more = plan.replace(lv, keep_mlp_layers=lv.keep_mlp_layers + 1)
    assert plan.gpu_bytes(s, lv) + pair <= cap < plan.gpu_bytes(s, one_more) + pair
    without = plan.predict(s, plan.replace(lv, keep_mlp_layers=0))
    assert cost.step_s < without.step_s - 0.03 * lv.keep_mlp_layers and cost.host_gib == without.host_gib
    assert plan.choose(plan.replace(s, seq_len=393216), 74.5, 126)[0].keep_mlp_layers == 0
    # 1M tokens on 8 GPUs: 7 blocks would fit, for 0.1% of the step; the headroom is kept
    s8 = plan.Shape.of(cfg, 1048576, 8, 8, 8, attn_backend="fa4").lora_shape()
    lv8, cost8 = plan.choose(s8, 74.5, 1907)
    assert lv8.keep_mlp_layers == 0 and cost8.gpu_gib < 30
    assert plan.choose(s, 139.2, 126, {"keep_mlp_layers": 3})[0].keep_mlp_layers == 3
    assert plan.choose(plan.Shape.of(cfg, 131072, 1, 1, 1, attn_backend="fa4", param_bytes=2,
                                     stochastic_rounding=True), 139.2, 126)[0].keep_mlp_layers == 0


def test_no_fit_names_lora_qlora_and_a_length_that_fit():
    """Qwen3-8B on one GPU of 80 GB (the cost model's prediction, not a measurement): a full fine-tune never fits;
    --fit auto names LoRA where LoRA fits, QLoRA where only it does, and with a length where neither fits at this
    one. A LoRA run that does not fit is told of --quantize nf4 or a --seq_len."""
    def no_fit(s):
        with pytest.raises(plan.NoFit) as e:
            plan.choose(s, 74.5, 1907)
        return str(e.value)

    def fits(s):
        try:
            return bool(plan.choose(s, 74.5, 1907))
        except plan.NoFit:
            return False
    full = {n: shape(seq_len=n, cp=1, world=1, per_node=1) for n in (131072, 524288, 1048576)}
    assert "--lora_rank 16 (LoRA" in no_fit(full[131072]) and fits(full[131072].lora_shape())
    assert "--lora_rank 16 --quantize nf4 (LoRA" in no_fit(full[524288])
    assert fits(full[524288].lora_shape(quantize="nf4")) and not fits(full[524288].lora_shape())
    assert "--lora_rank 16 --quantize nf4 --seq_len 524288 (LoRA" in no_fit(full[1048576])
    assert not fits(full[1048576].lora_shape(quantize="nf4"))
    assert "--quantize nf4 (QLoRA" in no_fit(full[524288].lora_shape())
    assert "--seq_len 524288, or more GPUs" in no_fit(full[1048576].lora_shape(quantize="nf4"))


def test_a_cpu_runs_ram_is_predicted(monkeypatch):
    """On a CPU, fit.cpu_ram_bytes (plan.py's peak per rank, and rank 0's full copy of the weights while it loads
    them) against the peak host memory measured on a 2-core CPU machine (bench/results/cpu_ram_2026-12-06.json):
    LoRA at 1 and 2 ranks and a full fine-tune, predicted within -1% to +6% (+1.8%, +0.9%, +5.7%)."""
    import json
    from million import config, fit
    with open(os.path.join(ROOT, "bench", "results", "cpu_ram_2026-12-06.json")) as fh:
        runs = json.load(fh)["runs"]
    for run in runs:
        cfg = config.TrainConfig(**{**config.PRESETS["demo"], "model": os.path.join(ROOT, run["model"]),
                                    "seq_len": 256, "lora_rank": run["lora_rank"]})
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(run["ranks"]))
        per_rank, load = fit.cpu_ram_bytes(cfg, hf.read_config(cfg.model), run["ranks"])
        assert -0.01 < (run["ranks"] * per_rank + load) / (run["peak_kib"] * 1024) - 1 < 0.06, run


# --- Qwen3.5 ---------------------------------------------------------------------------------------------

Q35_RUNS = os.path.join(ROOT, "bench", "results", "qwen3_5_fla_2026-12-05b")  # fla's conv, the rule inputs in fla
Q35_LATER = os.path.join(ROOT, "bench", "results", "qwen3_5_h200_2026-12-06")  # the same H200 code, with the tiled
# MoE's backward skipping frozen weights: QLoRA, 524,288 tokens, the 35B-A3B (the earlier folders' other runs no
# longer describe the code: F.conv1d and the rule inputs eager, or the MoE's frozen weights given gradients)
Q35_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def q35_shape(seq_len, lora_rank=16, **kw):
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-9b"))
    return plan.Shape.of(mcfg, seq_len, 1, 1, 1, attn_backend="fa4", lora_rank=lora_rank,
                         lora_targets=Q35_TARGETS if lora_rank else (), **kw)


def test_qwen3_5_counts_are_the_models():
    """The hybrid's parameters, matmul parameters (every nn.Linear: gated q_proj, the DeltaNet projections, the
    head), LoRA adapters on all twelve projection kinds and the NF4 share (QLoRA: every block projection) are the
    9B model's own, built on meta; attention FLOPs count its 8 attention layers, not 32."""
    from million import lora
    from million.qwen3_5 import Qwen3_5
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-9b"))
    with torch.device("meta"):
        m = Qwen3_5(mcfg)
    s = q35_shape(131072, lora_rank=0)
    assert s.params == sum(p.numel() for p in m.parameters()) == 8_953_803_264
    assert plan.matmul_params(s) == sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear))
    assert s.attn_layers == 8 and plan.attention_fwd_flops(s) == 2 * 131072 ** 2 * 16 * 256 * 8
    with torch.device("meta"):
        adapted = lora.apply(Qwen3_5(mcfg), 16, targets=Q35_TARGETS)
    assert q35_shape(131072).lora_params == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert s.lora_shape().lora_targets == Q35_TARGETS
    nf4 = sum(x.weight.numel() for x in adapted.modules() if isinstance(x, lora.LoRALinear))
    head = s.vocab * s.hidden
    assert q35_shape(131072, quantize="nf4").nf4_params == nf4 == plan.matmul_params(s) - head


def test_qwen3_5_moe_counts_are_the_models():
    """Qwen3.5-MoE at the 35B-A3B shape (transformers' Qwen3_5MoeConfig defaults, a vision-language config.json):
    stored parameters (every expert, the shared experts and their gates) equal the model's, built on meta; the
    active ones count top-8 of 256 experts plus the shared expert; the LoRA adapters on attention and DeltaNet
    projections equal lora.apply's."""
    from million import lora
    from million.qwen3_5 import Qwen3_5Moe
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-35b-a3b"))
    with torch.device("meta"):
        m = Qwen3_5Moe(mcfg)
    s = plan.Shape.of(mcfg, 131072, 1, 1, 1)
    assert s.params == sum(p.numel() for p in m.parameters()) == 34_660_610_688
    assert (s.sparse_layers, s.experts, s.top_k, s.shared_intermediate) == (40, 256, 8, 512)
    block = m.layers[0].mlp
    per_block = sum(p.numel() for p in block.parameters())
    active = per_block - (256 - 8) * 3 * 2048 * 512
    assert s.active_params == s.params - 40 * (per_block - active) and round(s.active_params / 1e9, 2) == 3.45
    for targets in (lora.ATTENTION + lora.DELTANET, lora.TARGETS + (lora.EXPERTS,)):
        with torch.device("meta"):
            adapted = lora.apply(Qwen3_5Moe(mcfg), 16, targets=targets)
        a = plan.Shape.of(mcfg, 131072, 1, 1, 1, lora_rank=16, lora_targets=targets)
        assert a.lora_params == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    # a token meets the adapters of its 8 experts, not of all 256: 16 x 8 x (2 H + 3 I) a layer, the others' alike
    assert a.lora_params - a.lora_active_params == 16 * (256 - 8) * (2 * 2048 + 3 * 512) * 40


def second_step(folder, name):
    """(step s, peak GiB, pinned host GiB) of a run's second step (the first holds the warm-up)."""
    import json
    with open(os.path.join(folder, f"{name}.metrics.jsonl")) as fh:
        row = [json.loads(line) for line in fh][-1]
    assert row["step"] == 2
    return row["step_time_s"], row["peak_mem_gib"], row["host_pinned_gib"]


def q35_runs():
    """The measured steps: (kind, tokens, levers, step s, peak GiB, pinned host GiB). The QLoRA and
    524,288-token runs came a day after the fit, on the same code, and were predicted before they ran."""
    runs = []
    for folder, kind, tokens, lv, name in (
            (Q35_RUNS, "lora", 131072, plan.Levers(32, 32), ""),
            (Q35_RUNS, "full", 131072, plan.Levers(32, 32), ""),
            (Q35_RUNS, "lora", 131072, plan.Levers(32, 32, keep_mlp_layers=11), "_fit_auto"),
            (Q35_LATER, "qlora", 131072, plan.Levers(32, 32), ""),
            (Q35_LATER, "lora", 524288, plan.Levers(23, 32, deltanet_tile=16384), "")):
        runs.append((kind, tokens, lv) + second_step(folder, f"q35_{kind}_{tokens}{name}"))
    return runs


def test_qwen3_5_steps_are_predicted():
    """The DeltaNet constants are the 131k LoRA run's residual (its step and peak less the rest of the model), and
    with them the other runs are predicted, time within 5% and GPU peak within 9% (on the safe side), pinned host
    exact (the offloaded blocks' inputs and the attention layers' kept outputs: DeltaNet blocks keep none): the fit
    itself (memory +2.1%), the full fine-tune (time +0.1%, memory +7.6%), the plan --fit auto chose (11 blocks keep
    their MLP's gate and up outputs: -0.0%, +8.5%), QLoRA (+2.1%, +4.1%) and 524,288 tokens in pieces of 16,384
    (-1.7%, +1.2%). The runs predate the recomputed block's output freed before its backward: their peaks are
    compared less that tensor, as bench/fit_plan.py takes it off the fitted runs (the DeltaNet's working set was
    read off the raw peak, so it still counts it: on the safe side)."""
    k = plan.FITTED
    for kind, tokens, lv, step_s, peak, host in q35_runs():
        s = q35_shape(tokens, **dict(lora={}, qlora=dict(quantize="nf4"),
                                     full=dict(lora_rank=0, param_bytes=2, stochastic_rounding=True))[kind])
        c = plan.predict(s, lv, k)
        if (kind, tokens, lv.keep_mlp_layers) == ("lora", 131072, 0):  # the fits: what the constants were read from
            rest = replace(k, deltanet_s_per_mtoken_layer=0.0, deltanet_work_bytes_per_token=0.0)
            per = (step_s - plan.step_seconds(s, lv, rest)) / (24 * tokens / 1e6)
            work = (peak * 2**30 - plan.gpu_bytes(s, lv, rest) + k.work_bytes_per_token_hidden * s.hidden * tokens)
            assert per == pytest.approx(k.deltanet_s_per_mtoken_layer, rel=2e-3)
            assert work / tokens == pytest.approx(k.deltanet_work_bytes_per_token, rel=2e-3)
        assert abs(c.step_s / step_s - 1) < 0.05, (kind, tokens, c.step_s, step_s)
        now = peak - fit_plan.held_output_gib(s)
        assert -0.005 < c.gpu_gib / now - 1 < 0.09, (kind, tokens, c.gpu_gib, now)
        assert c.host_gib == pytest.approx(host, rel=1e-3), (kind, tokens, c.host_gib, host)


def test_qwen3_5_moe_steps_are_under_predicted_as_written_down():
    """The 35B-A3B's LoRA steps at 131k (one H200) against the plan: memory on the safe side (+4.2% to +4.8%, since
    the plan stopped counting fp32 gradient buffers for frozen experts; +9.2% before), pinned host exact, the time
    short: 6.2% with attention and DeltaNet adapted, 6.4% with the shared expert's adapters too,
    9.3% with the routed experts' (bench/NOTES.md, "The 35B-A3B, QLoRA and 524k on this code"). What the plan
    lacks is the MoE's: the step was 23.94 s (12% short) while the tiled backward computed the frozen experts'
    weight gradients, which the plan rightly does not count under LoRA; skipping them took it to 22.36 s, as
    predicted. The rest is not split yet: 512-wide experts with ~512 rows each in a tile (the MoE term was fitted
    to Qwen3-MoE's 768 wide, 1,024 rows), and the routed experts' adapters at about twice the dense adapters' rate
    (the same ratio on an H100). This pins the measured misses rather than fitting a constant to them; a change
    to the MoE terms that moves them fails here and should update the note. These runs predate moe._Rows (the row
    permutations' backward as gathers: -3.9 ms a tile on an H100, about -1 s a step counted, not yet measured on
    a step), so the code now should miss by less than pinned here."""
    from million import lora
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-35b-a3b"))
    for targets, name, short in ((lora.ATTENTION + lora.DELTANET, "", 0.062),
                                 (lora.ATTENTION + lora.DELTANET + lora.MLP_PROJECTIONS, "_shared", 0.064),
                                 (lora.ATTENTION + lora.DELTANET + (lora.EXPERTS,), "_experts", 0.093)):
        s = plan.Shape.of(mcfg, 131072, 1, 1, 1, attn_backend="fa4", lora_rank=16, lora_targets=targets)
        step_s, peak, host = second_step(Q35_LATER, f"q35-35b-a3b_lora_131072{name}")
        c = plan.predict(s, plan.Levers(s.layers, s.layers))
        assert c.step_s / step_s - 1 == pytest.approx(-short, abs=0.005), (name, c.step_s, step_s)
        assert 0.03 < c.gpu_gib / peak - 1 < 0.05, (name, c.gpu_gib, peak)
        assert c.host_gib == pytest.approx(host, rel=1e-3)


def test_qwen3_5_on_an_h100_at_trl_s_other_lengths_as_written_down():
    """The 9B's LoRA at 65,536 and 262,144 tokens with --fit auto on one H100 (TRL's table's other two lengths):
    the levers the plan chose then (fla's memory outside the allocator not yet kept free), its time within 5% at
    the H200's rates (-4.0%, -2.4%), pinned host exact, and its memory: 3.9% over at 65k and **1.6% over** at 262k
    (DeltaNet in pieces). The 262k run is the latest, on the code that no longer holds FSDP2's root through the
    backward, the recompute's output in its block's backward or a copy of cos and sin per block: 46.4 GiB as
    predicted (46.3), from 54.0 (8.9% under) before those three fixes and 55.5 (11.3% under) before gated
    attention's q and gate were copied out (bench/NOTES.md, "The three memory fixes, measured"). Pinned, not
    fitted: a change to the memory terms that moves them fails here and should update the note."""
    before = os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-06g")
    after = os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-07d")
    for tokens, lv, memory, results in (
            (65536, plan.Levers(32, 32, keep_mlp_layers=12), 0.039, before),
            (262144, plan.Levers(32, 32, deltanet_tile=plan.DELTANET_TILE), 0.016, after)):
        step_s, peak, host = second_step(results, f"q35_lora_{tokens}")
        s = replace(q35_shape(tokens), attn_backend="cudnn")
        c = plan.predict(s, lv)
        assert abs(c.step_s / step_s - 1) < 0.05, (tokens, c.step_s, step_s)
        assert c.gpu_gib / peak - 1 == pytest.approx(memory, abs=0.005), (tokens, c.gpu_gib, peak)
        assert c.host_gib == pytest.approx(host, rel=1e-3)
        assert plan.choose(replace(s, outside_bytes=0.0), 78.0, 126)[0] == lv  # --fit auto's choice on 78.0 free


def test_qwen3_5_lora_131k_on_an_h100_as_written_down():
    """The 9B's LoRA at 131,072 tokens with --fit auto on one H100 (2026-12-08, the code of the three memory fixes):
    every block offloaded and keeping attention, as the plan chose; 22.54 s against its 22.15 at the H200's rates
    (-1.7%), pinned host exact, and 41.93 GiB allocated against 47.51 (+13.3%). The DeltaNet's working set was read
    off the 131k run of 2026-12-05, whose peak still held FSDP2's root (the embedding and head gathered, 2 x vocab x
    hidden x 2 B) and the recomputed block's output: less those two the plan is +1.9%. Not refitted (it errs on the
    safe side, and --fit auto's H200 plans would move by about one block keeping its MLP outputs); pinned so that a
    change to the memory terms that moves it fails here and updates bench/NOTES.md."""
    step_s, peak, host = second_step(os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-08"),
                                     "q35_lora_131072")
    s = replace(q35_shape(131072), attn_backend="cudnn")
    lv, c = plan.choose(s, 78.0, 126)
    assert lv == plan.Levers(s.layers, s.layers), lv
    assert c.step_s / step_s - 1 == pytest.approx(-0.017, abs=0.005), (c.step_s, step_s)
    assert c.gpu_gib / peak - 1 == pytest.approx(0.133, abs=0.005), (c.gpu_gib, peak)
    stale = 2 * s.vocab * s.hidden * s.act_bytes / 2**30 + fit_plan.held_output_gib(s)
    assert (c.gpu_gib - stale) / peak - 1 == pytest.approx(0.019, abs=0.005), (c.gpu_gib, stale, peak)
    assert c.host_gib == pytest.approx(host, rel=1e-3)


def test_qwen3_lora_on_this_code_as_written_down():
    """Qwen3-8B's LoRA r16 (every linear, every block offloaded and keeping attention) on one H100 with cuDNN, on
    the code that no longer holds FSDP2's root, the recompute's output or per-block cos and sin in the backward:
    at 131,072 tokens 31.2 GiB against the refitted plan's 31.1 (-0.2%; 36.94 before the fixes, ~31.4 predicted),
    43.95 s against 44.5 at the H200's rates; at 65,536 tokens (bench/memory_ab.sh's run, one step) 25.3 GiB against
    24.4 (-3.5%, the unsafe side: the two offloaded blocks in flight, which the plan leaves out, weigh more at the
    shorter length; bench/NOTES.md, "The three memory fixes, measured"). The 65k step shared the card with the
    A/B's other run, so its time is not compared. Pinned, not fitted."""
    import json
    from million import lora
    d = os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-07d")
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3-8b"))
    for tokens, name, memory in ((131072, "qwen3-8b_lora_131072", -0.002), (65536, "ab8b_after", -0.035)):
        with open(os.path.join(d, f"{name}.metrics.jsonl")) as fh:
            row = [json.loads(line) for line in fh][-1]
        s = plan.Shape.of(mcfg, tokens, 1, 1, 1, attn_backend="cudnn", lora_rank=16, lora_targets=lora.TARGETS)
        c = plan.predict(s, plan.Levers(s.layers, s.layers))
        assert c.gpu_gib / row["peak_mem_gib"] - 1 == pytest.approx(memory, abs=0.005), (tokens, c.gpu_gib, row)
        assert c.host_gib == pytest.approx(row["host_pinned_gib"], rel=1e-3)
    s = plan.Shape.of(mcfg, 131072, 1, 1, 1, attn_backend="cudnn", lora_rank=16, lora_targets=lora.TARGETS)
    assert plan.predict(s, plan.Levers(36, 36)).step_s / 43.95 - 1 == pytest.approx(0.012, abs=0.005)


def test_qwen3_5_moe_qlora_fits_an_80_gb_gpu_as_planned():
    """The 35B-A3B with QLoRA (the routed experts in NF4 too) at 131k on one H100 80GB: 43.1 GiB at the peak, the
    plan's 50.0 on the safe side (+16%: the rest of the step's memory as the bf16 run over-counts it, +4.3%, and
    one layer's experts dequantized counted whole), pinned host exact. Its time is an H100's (23.38 s with cuDNN),
    which the plan, fitted on H200s, does not predict."""
    from million import lora
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-35b-a3b"))
    s = plan.Shape.of(mcfg, 131072, 1, 1, 1, attn_backend="cudnn", lora_rank=16,
                      lora_targets=lora.ATTENTION + lora.DELTANET, quantize="nf4")
    _, peak, host = second_step(os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-06d"),
                                "q35-35b-a3b_lora_131072")
    c = plan.predict(s, plan.Levers(s.layers, s.layers))
    assert 0.14 < c.gpu_gib / peak - 1 < 0.18 and c.gpu_gib < 0.92 * 79.1, (c.gpu_gib, peak)
    assert c.host_gib == pytest.approx(host, rel=1e-3)


def test_qwen3_5_moe_qlora_at_393k_on_an_h100_as_planned():
    """The 35B-A3B with QLoRA at 393,216 tokens with --fit auto on one H100 80GB (every block offloaded and keeping
    attention, the DeltaNet in pieces of 16,384): 145.62 s a step against the plan's 142.1 (-2.4%, at the H200's
    rates), pinned host exact. Measured before the root, the recompute's output and the per-block cos and sin left
    the backward (~52.0 GiB predicted since: bench/NOTES.md, "The 9B's 262k peak, traced"): 59.0 GiB, 57.5 less
    the recompute's output (as bench/fit_plan.py compares such runs). The plan, gated attention counted at (hidden
    + query) / 2 since the 458,752-token run, says 53.0: 7.7% under this run of the code before those fixes, 2%
    over what they were predicted to leave (63.2, +9.9%, when it counted the query width). Pinned, not fitted."""
    from million import lora
    s = plan.Shape.of(hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-35b-a3b")), 393216, 1, 1, 1,
                      attn_backend="cudnn", lora_rank=16, lora_targets=lora.ATTENTION + lora.DELTANET,
                      quantize="nf4")
    step_s, peak, host = second_step(os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-07c"),
                                     "q35-35b-a3b_lora_393216")
    lv, c = plan.choose(s, 78.0, 126)
    assert lv == plan.Levers(s.layers, s.layers, deltanet_tile=plan.DELTANET_TILE)
    assert c.step_s / step_s - 1 == pytest.approx(-0.024, abs=0.005), (c.step_s, step_s)
    peak -= fit_plan.held_output_gib(s)
    assert c.gpu_gib / peak - 1 == pytest.approx(-0.077, abs=0.005), (c.gpu_gib, peak)
    assert c.host_gib == pytest.approx(host, rel=1e-3)


def test_runs_on_this_code_as_written_down():
    """Measured on one H100 with cuDNN after the three memory fixes, predicted before the runs (bench/NOTES.md, "The
    two full fine-tunes and the 35B-A3B at 458,752 tokens, measured"). Qwen3-1.7B and 4B full fine-tunes at 131,072
    tokens (bf16 weights and AdamW, every block offloaded and keeping attention): 20.90 and 41.82 GiB against the
    plan's 22.47 (+7.5%) and 41.59 (-0.5%). The 35B-A3B's QLoRA at 458,752 tokens with --fit auto on the card's 78.0
    GiB, then the longest the plan fitted there: 190.48 s against 186.4 at the H200's rates (-2.1%), 57.56 GiB
    allocated against 69.9 (+21.5%) when the plan counted gated attention's working set by its query width, while
    the card held 74.9 GiB at its high water (the allocator's cache with the fixed segments every run then had,
    which its over-count covered; bench/RESULTS.md, "The allocator's cache"). By (hidden + query) / 2, since: 58.1
    GiB (+1.0%), and 524,288 tokens planned on that card (71.1 GiB, two blocks not offloaded: the host holds 38),
    655,360 not; 524,288 then ran on an H100 (2026-12-08). Pinned host exact. Pinned, not fitted."""
    import json
    from million import lora
    d = os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-07e")
    with open(os.path.join(d, "train_steps_full_131k.json")) as fh:
        full = {r["model"]: r for r in json.load(fh)}
    for model, memory in (("qwen3-1.7b", 0.075), ("qwen3-4b", -0.005)):
        s = plan.Shape.of(hf.read_config(os.path.join(ROOT, "bench", "configs", model)), 131072, 1, 1, 1,
                          param_bytes=2, attn_backend="cudnn")
        c = plan.predict(s, plan.Levers(s.layers, s.layers))
        assert c.gpu_gib / full[model]["peak_mem_gib"] - 1 == pytest.approx(memory, abs=0.005), (model, c.gpu_gib)
        assert c.host_gib == pytest.approx(full[model]["host_offload_gib"], rel=1e-3)
    s = plan.Shape.of(hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-35b-a3b")), 458752, 1, 1, 1,
                      attn_backend="cudnn", lora_rank=16, lora_targets=lora.ATTENTION + lora.DELTANET,
                      quantize="nf4")
    step_s, peak, host = second_step(d, "q35-35b-a3b_lora_458752")
    lv, c = plan.choose(s, 78.0, 126)
    assert lv == plan.Levers(s.layers, s.layers, deltanet_tile=plan.DELTANET_TILE)
    assert c.step_s / step_s - 1 == pytest.approx(-0.021, abs=0.005), (c.step_s, step_s)
    assert c.gpu_gib / peak - 1 == pytest.approx(0.010, abs=0.005), (c.gpu_gib, peak)
    assert c.host_gib == pytest.approx(host, rel=1e-3)
    s524 = replace(s, seq_len=524288)
    lv, c = plan.choose(s524, 78.0, 126)
    assert lv == plan.Levers(38, s.layers, deltanet_tile=plan.DELTANET_TILE), lv
    assert c.gpu_gib == pytest.approx(71.1, abs=0.1) and c.host_gib == pytest.approx(112.3, abs=0.1), c
    # ... and run on an H100 (2026-12-08, the allocator capped at 78 GiB): 243.44 s (the plan -2.7%), 63.15 GiB
    # allocated (the plan +12.6%). The miss is the two blocks left on the GPU (2 x 2.0 GiB of input, 4.03 of kept
    # attention): the last blocks, whose backward runs first and frees them before an offloaded block's backward
    # makes the peak. The same levers with every block offloaded are predicted at the measured peak
    step_s, peak, host = second_step(os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-08"),
                                     "qlora_moe_524k")
    assert c.step_s / step_s - 1 == pytest.approx(-0.027, abs=0.005), (c.step_s, step_s)
    assert c.gpu_gib / peak - 1 == pytest.approx(0.126, abs=0.005), (c.gpu_gib, peak)
    assert plan.predict(s524, replace(lv, offload_layers=s.layers)).gpu_gib == pytest.approx(peak, rel=5e-3)
    assert c.host_gib == pytest.approx(host, rel=1e-3)
    with pytest.raises(plan.NoFit) as e:
        plan.choose(replace(s, seq_len=655360), 78.0, 126)
    assert "--seq_len 589824" in str(e.value), str(e.value)


def test_qwen3_5_moe_holds_gated_attention_by_hidden_and_query():
    """The 35B-A3B with QLoRA past 131k, the DeltaNet in pieces of 16,384: the peak is gated attention's backward,
    about half of whose working set is as wide as its query (16 x 256), half as wide as hidden (2048). Counted by
    hidden, the plan said 37.2 GiB at 262,144 tokens (measured 50.5) and 524,288 ran out of memory on an H100
    past 70.9 GiB (2026-12-06); counted by the query width, it was 21.5% over the 458,752-token run after the
    three memory fixes. At (hidden + query) / 2: that run +1.0% (test_runs_on_this_code_as_written_down), and a
    12-layer cut traced at 524,288 tokens after the gate's fix (2026-12-07b) 2.5% under, inside the plan's 8%
    margin: its peak less the recompute's output and FSDP2's root (the embedding and head gathered, 2 x vocab x
    hidden x 2 B), neither held since. The runs of 2026-12-06e still held q and the gate copied out of q_proj's
    output: only their pinned host is compared (exact)."""
    import json
    from million import lora
    d = os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-06e")
    with open(os.path.join(d, "cut_q35-35b-a3b_lora_524288.metrics.jsonl")) as fh:
        cut = json.loads(fh.readline())                     # one step, traced: its peak is the run's
    runs = [("qwen3_5-35b-a3b", 262144, second_step(d, "q35-35b-a3b_lora_262144")[2]),
            ("qwen3_5-35b-a3b-12l", 524288, cut["host_pinned_gib"])]
    for model, tokens, host in runs:
        mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", model))
        s = plan.Shape.of(mcfg, tokens, 1, 1, 1, attn_backend="cudnn", lora_rank=16,
                          lora_targets=lora.ATTENTION + lora.DELTANET, quantize="nf4")
        c = plan.predict(s, plan.Levers(s.layers, s.layers, deltanet_tile=16384))
        assert c.host_gib == pytest.approx(host, rel=1e-3)
    with open(os.path.join(ROOT, "bench", "results", "qwen3_5_h100_2026-12-07b",
                           "cut_q35-35b-a3b_lora_524288.metrics.jsonl")) as fh:
        root = 2 * s.vocab * s.hidden * s.act_bytes / 2**30
        now = json.loads(fh.readline())["peak_mem_gib"] - fit_plan.held_output_gib(s) - root
    assert c.gpu_gib / now - 1 == pytest.approx(-0.025, abs=0.005), (c.gpu_gib, now)
    s = plan.Shape.of(hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3_5-35b-a3b")), 524288, 1, 1, 1,
                      attn_backend="cudnn", lora_rank=16, lora_targets=lora.ATTENTION + lora.DELTANET,
                      quantize="nf4")
    # under cp the DeltaNet is not in pieces (they are for cp 1 only): 524,288 tokens fit 4 ranks, not 2
    plan.choose(replace(s, cp=4, world=4, ranks_per_node=4), 79.1, 4 * 126)
    with pytest.raises(plan.NoFit) as e:
        plan.choose(replace(s, cp=2, world=2, ranks_per_node=2), 79.1, 2 * 126)
    assert "--cp 4 " in str(e.value), str(e.value)


def test_qwen3_5_under_cp_counts_the_summaries_as_measured():
    """Under context parallelism the DeltaNet term grows by the span summaries' measured rate (bench/deltanet_layer.py
    at a rank's 131,072 tokens: the rule's cp form over the rule, measured as the rule was called before fla took
    its inputs), not by (dk + dv) / dv on the whole term."""
    one, eight = q35_shape(131072), replace(q35_shape(1048576), cp=8)  # 8 ranks of 131,072 tokens
    assert eight.tokens == one.tokens
    measured = ((55.49 + 15.45) - (33.8 + 8.19)) / 1e3  # s a layer-step (fwd + bwd + one more fwd), 131,072 tokens
    extra = plan.deltanet_seconds(eight) - plan.deltanet_seconds(one)
    assert extra == pytest.approx(measured * 24, rel=2e-3)
    assert 1.4 < plan.deltanet_seconds(eight) / plan.deltanet_seconds(one) < 1.5  # (dk + dv) / dv: 2


def test_qwen3_5_no_fit_names_what_fits():
    """Where no plan fits on one H200, the hint names the longest length that does, in steps of 65,536 above the
    halving that fits (393,216): with its own levers, not the failed plan's. Host memory bounds the hybrid's length
    there (what offload holds), so --quantize nf4, which saves GPU memory, fits no longer and is not suggested."""
    with pytest.raises(plan.NoFit) as e:
        plan.choose(q35_shape(786432), 139.7, 126)
    hinted = int(re.search(r"--seq_len (\d+)", str(e.value)).group(1))
    assert hinted == 589824 and "nf4" not in str(e.value)
    plan.choose(q35_shape(hinted), 139.7, 126)                       # fits
    with pytest.raises(plan.NoFit):
        plan.choose(q35_shape(hinted + 65536), 139.7, 126)
    with pytest.raises(plan.NoFit) as e:
        plan.choose(q35_shape(589824, lora_rank=0, param_bytes=2, stochastic_rounding=True), 139.7, 126)
    assert "--lora_rank 16" in str(e.value) and "nf4" not in str(e.value)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3_5-35b-a3b"])
def test_a_moe_is_told_the_lora_it_takes(name):
    """A mixture of experts whose full fine-tune fits no plan on one H200 is told LoRA with the targets lora.py
    takes for it: Qwen3-MoE attention only (named, since the default is refused), Qwen3.5-MoE the default (every
    projection; the MLP names adapt its shared expert). bf16 LoRA fits both, so neither is told QLoRA (while fla's
    autotuner's 6.4 GiB stayed held, the 35B-A3B's did not fit). The plan it tried counted those adapters, and
    fits."""
    import re
    from million import lora
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", name))
    with pytest.raises(plan.NoFit) as e:
        plan.choose(plan.Shape.of(mcfg, 524288, 1, 1, 1, attn_backend="fa4"), 139.7, 126)
    named = re.search(r"--lora_rank 16 --lora_targets (\S+) ", str(e.value))
    targets = named.group(1).split(",") if named else list(lora.TARGETS)
    assert lora.moe_targets_error(mcfg, targets) is None and "--seq_len" not in str(e.value).split("--lora_rank")[1]
    assert "nf4" not in str(e.value)
    plan.choose(plan.Shape.of(mcfg, 524288, 1, 1, 1, attn_backend="fa4").lora_shape(), 139.7, 126)
    assert set(plan.Shape.of(mcfg, 524288, 1, 1, 1).lora_shape().lora_targets) == set(targets)
    if name.startswith("qwen3-"):
        assert named and lora.moe_targets_error(mcfg, lora.TARGETS) == (
            "--lora_targets gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj: not "
            "projections of Qwen3-MoE (its MLP is its routed experts); pass --lora_targets q_proj,k_proj,v_proj,o_proj "
            "(attention), with ,experts to adapt the experts too")
    else:
        assert not named and "--lora_rank 16 (LoRA" in str(e.value)


def test_fla_s_memory_outside_the_allocator_is_left_free():
    """fla's kernels hold memory outside PyTorch's allocator during a run (the local memory of the configs its
    autotuner kept: 308 MiB on an H100, bench/gpu_overhead.py), after the plan has read the free memory: a Qwen3.5
    plan on fla leaves FLA_OUTSIDE_BYTES free beside GPU_MARGIN, one on the torch rule (the CPU's) does not, nor
    does a Qwen3. Before qwen3_5.build gave back what the autotuner's trials reserved, that was 6.4 GiB, and the
    65,536-token plan on an H100 kept 12 blocks' MLP outputs, 67.1 GiB allocated with the card at 77.4 of its
    79.6 GiB; it now keeps 11."""
    card = 78.0  # free on an 80 GB H100 before the model is built
    fla, torch_rule = (replace(q35_shape(65536, deltanet_kernel=k), attn_backend="cudnn") for k in ("fla", "torch"))
    assert fla.outside_bytes == plan.FLA_OUTSIDE_BYTES and torch_rule.outside_bytes == 0
    (lv, c), (lv_torch, c_torch) = plan.choose(fla, card, 126), plan.choose(torch_rule, card, 126)
    assert lv_torch.keep_mlp_layers == 12 and lv.keep_mlp_layers == 11, (lv, lv_torch)
    assert c.gpu_gib < c_torch.gpu_gib and c.gpu_gib <= plan.GPU_MARGIN * card - plan.FLA_OUTSIDE_BYTES / 2**30
    qwen3 = plan.Shape.of(hf.read_config(os.path.join(ROOT, "bench", "configs", "qwen3-8b")), 131072, 1, 1, 1,
                          deltanet_kernel="fla")
    assert qwen3.outside_bytes == 0
    with pytest.raises(plan.NoFit, match=r"plan limit 71\.3 of 78\.0"):  # 0.92 x 78.0 - 0.5, in what it says
        plan.choose(q35_shape(1048576), card, 126)
    from million import config, fit
    from million.qwen3_5 import Qwen3_5Config
    cfg, _ = config.parse_args(["--config", "demo"])
    if not torch.cuda.is_available():  # train.py on a CPU: auto is the torch rule, which holds nothing outside
        assert fit.plan_shape(cfg, Qwen3_5Config.tiny(), 1).outside_bytes == 0


def test_qwen3_5_deltanet_pieces_only_where_nothing_fits_whole():
    """--fit auto cuts the DeltaNet layers into pieces (deltanet_tile) only where no plan fits without: not at
    131,072 tokens on one H200, at 524,288 (which then fits, by prediction), never under context parallelism;
    the pieces lower the DeltaNet working set to a piece's and cost one more forward of the layer."""
    assert plan.choose(q35_shape(131072), 139.7, 126)[0].deltanet_tile == 0
    lv, c = plan.choose(q35_shape(524288), 139.7, 126)
    assert lv.deltanet_tile == plan.DELTANET_TILE and c.gpu_gib <= plan.GPU_MARGIN * 139.7
    whole = replace(lv, deltanet_tile=0)
    s = q35_shape(524288)
    assert plan.gpu_bytes(s, whole) - plan.gpu_bytes(s, lv) > 50 * 2**30
    assert plan.step_seconds(s, lv) - plan.step_seconds(s, whole) == pytest.approx(
        plan.tiled_deltanet_seconds(s, lv), rel=1e-12) and plan.tiled_deltanet_seconds(s, lv) > 0
    cp2 = replace(s, cp=2, world=2, ranks_per_node=2)
    assert plan.choose(cp2, 139.7, 252)[0].deltanet_tile == 0
