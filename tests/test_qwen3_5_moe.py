"""Qwen3.5-MoE (million/qwen3_5.py's Qwen3_5Moe, moe.py's SharedExpertMoE and RouterLoss): against transformers'
Qwen3_5MoeForCausalLM (logits, the loss with its load-balancing term, every gradient), its checkpoints in both expert
layouts, the memory levers, context parallelism (cp 2 and 4 under gloo) and LoRA against PEFT. The hybrid's own parts
(DeltaNet, gated attention, documents) are tested in test_qwen3_5.py; the experts' in test_moe.py.

    python -m pytest tests/test_qwen3_5_moe.py -q
"""
import json

import pytest
import torch
import torch.distributed as dist

from million import documents
from million.deltanet import DeltaNetMixer
from million.qwen3_5 import Qwen3_5MoeConfig, from_pretrained, hf_name, read_config, save_pretrained
from parallel import RingAttention, cp_shard
from test_qwen3_5 import DOCS, T, assert_grads_close, doc_inputs, grads, inputs, make_model
from test_ring import run_ranks

COEF = 0.1  # router_aux_loss_coef, 100x transformers' default: the load-balancing term's gradient is not lost


def cfg(**kw):
    """The tiny hybrid (3 DeltaNet layers, 1 attention layer) with 7 experts of width 24, top 3, and a shared
    expert of width 40 in every layer; the load-balancing loss on."""
    return Qwen3_5MoeConfig.tiny(**{"output_router_logits": True, "router_aux_loss_coef": COEF, **kw})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def step(model, ids, labels, pos=None, docs=None):
    """Forward with labels and backward of the total (the summed NLL and the load-balancing term) -> the MoENLL."""
    out = model(ids, pos, labels=labels, doc_lens=docs)
    out.total().backward()
    return out


def hf_grad(params, name, c):
    """transformers' gradient for our parameter `name`: its experts hold gate and up fused, [E, 2 I, H]."""
    module, _, weight = hf_name(name, c).rpartition(".")
    if module.endswith("mlp.experts") and weight != "down_proj":
        return params[f"{module}.gate_up_proj"].grad.chunk(2, 1)[weight == "up_proj"]
    return params[hf_name(name, c)].grad


def test_matches_transformers(tmp_path):
    """fp32, our save loaded by transformers (AutoModelForCausalLM: Qwen3_5MoeForCausalLM, experts one tensor each):
    logits within 2e-6; outputs.loss (the mean NLL + coef x aux) within 1e-6 relative and coef x outputs.aux_loss
    equal to our aux_sum / trained tokens; every gradient of that loss within 1e-6 absolute + 1e-4 relative (the
    DeltaNet decay's, as for the dense model), the routers', experts' and shared experts' among them."""
    from transformers import AutoModelForCausalLM
    model = make_model(torch.float32, cfg())
    save_pretrained(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    ids, labels = inputs()
    out = model(ids, labels=labels)
    (out.total() / out.n_valid).backward()
    ref = hf(ids, labels=ids, output_router_logits=True)
    ref.loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), ref.logits, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.total() / out.n_valid, ref.loss, atol=0, rtol=1e-6)
    torch.testing.assert_close(out.aux_sum / out.n_valid, COEF * ref.aux_loss, atol=0, rtol=1e-6)
    assert ref.aux_loss > 1.0  # E * sum f_e P_e: 1 when balanced; a term that vanished would fail above
    params = dict(hf.named_parameters())
    for name, g in grads(model).items():
        torch.testing.assert_close(g, hf_grad(params, name, model.cfg), atol=1e-6, rtol=1e-4, msg=name)


def test_fused_and_composite_checkpoints(tmp_path):
    """The expert weights as transformers holds them (gate_up_proj [E, 2 I, H], down_proj [E, H, I]) in a
    qwen3_5_moe (vision-language) folder: read into the same weights exactly; a save writes them one per expert,
    passes the vision tower through, and transformers loads it with our logits."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3_5MoeConfig as Composite
    model = make_model(torch.float32, cfg())
    text = {k: v for k, v in model.cfg.to_hf_dict().items() if k != "architectures"}
    save_pretrained(model, tmp_path / "a")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)  # transformers fuses on load
    fused = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in fused
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(Composite(text_config=text, vision_config={"depth": 1}).to_dict()))
    vision = {"model.visual.merger.norm.bias": torch.randn(3)}
    save_file({**fused, **vision}, src / "model.safetensors")
    assert type(read_config(str(src))) is Qwen3_5MoeConfig
    loaded = from_pretrained(str(src), torch.float32)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t, atol=0, rtol=0, msg=name)
    save_pretrained(loaded, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.6.up_proj.weight" in saved and vision.keys() <= saved.keys()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids, _ = inputs()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model.logits(ids), atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("levers", [dict(recompute=True), dict(offload=True, keep_attention=True, mlp_tile=50)])
def test_levers_keep_values_and_gradients(levers, group_of_one):
    """fp64, the load-balancing term on: recomputed blocks (whose recompute must not count the routers twice),
    host offload, and the experts and the shared expert in tiles of 50 rows give the plain run's loss, aux and
    every gradient within 1e-12."""
    runs = []
    for lv in (dict(recompute=False), levers):
        model = make_model(torch.float64, cfg(), attn_fn=RingAttention(group_of_one)).set_levers(**lv)
        out = step(model, *inputs())
        runs.append((out.loss_sum.detach(), out.aux_sum.detach(), grads(model)))
    (l0, a0, g0), (l1, a1, g1) = runs
    torch.testing.assert_close(l1, l0, atol=0, rtol=1e-12)
    torch.testing.assert_close(a1, a0, atol=0, rtol=1e-12)
    assert_grads_close(g1, g0, str(levers), tol=1e-12)


def _cp_case(rank, world, group, docs):
    layout = documents.cp_layout(world, docs)
    model = make_model(torch.float64, cfg(), attn_fn=RingAttention(group, schedule=documents.schedule),
                       mixer=DeltaNetMixer(group, layout=documents.cp_layout),
                       cp_sum=lambda t: dist.all_reduce(t, group=group))
    ids, labels, pos = doc_inputs() if docs else (*inputs(), torch.arange(T).expand(2, T))
    out = step(model, *(cp_shard(x, 1, rank, world, layout) for x in (ids, labels, pos)), docs)
    return dict(loss_sum=out.loss_sum.detach(), aux_sum=out.aux_sum.detach(), grads=grads(model))


def _cp_main(rank, world, port, out_dir):
    from pathlib import Path
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save({docs: _cp_case(rank, world, dist.group.WORLD, docs) for docs in (None, DOCS)},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_device(world, tmp_path):
    """fp64, cp ranks under gloo (zigzag for one sequence, documents.cp_layout for the window of DOCS) against one
    device: the NLL and the load-balancing term (each rank's share, its counts all-reduced over the group) summed over
    the ranks within 1e-6 (both in loss.py's fp32), the gradients summed over the ranks within 1e-10."""
    ranks = run_ranks(world, tmp_path, main=_cp_main)
    for docs in (None, DOCS):
        model = make_model(torch.float64, cfg(), attn_fn=documents.masked_attention)
        ids, labels, pos = doc_inputs() if docs else (*inputs(), None)
        want = step(model, ids, labels, pos, docs)
        got, where = [r[docs] for r in ranks], f"world {world}, docs {docs}"
        torch.testing.assert_close(sum(r["loss_sum"] for r in got), want.loss_sum.detach(), atol=0, rtol=1e-6,
                                   msg=where)
        torch.testing.assert_close(sum(r["aux_sum"] for r in got), want.aux_sum.detach(), atol=0, rtol=1e-6,
                                   msg=where)
        assert_grads_close({n: sum(r["grads"][n] for r in got) for n in got[0]["grads"]}, grads(model), where)


@pytest.mark.parametrize("experts", [False, True])
@pytest.mark.parametrize("tile", [0, 7])
def test_lora_matches_peft(tmp_path, tile, experts):
    """lora.apply on every projection it takes (attention, DeltaNet, and the MLP names, which adapt the shared
    expert as PEFT's do), the routed experts frozen or (experts) adapted as PEFT's target_parameters adapt them,
    against PEFT on transformers' Qwen3_5MoeForCausalLM with the same adapter values, fp32: the loss with its
    load-balancing term within 1e-6 relative, every adapter's gradient within 2e-4 (as for the dense model), whole
    and with the MoE blocks in tiles of 7 rows under recompute (whose backward skips the frozen weights'
    gradients)."""
    import peft
    from transformers import AutoModelForCausalLM
    from million import lora
    from test_fa4 import rel
    from test_lora import ALPHA, RANK, adapted, peft_name
    targets = lora.TARGETS + ((lora.EXPERTS,) if experts else ())
    save_pretrained(make_model(torch.float32, cfg()), tmp_path)
    pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(lora.TARGETS), lora_dropout=0.0,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None))
    m = adapted(make_model(torch.float32, cfg()), targets)
    if tile:
        m.set_levers(recompute=True, mlp_tile=tile)
    theirs = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    ours = {n: p for n, p in m.named_parameters() if p.requires_grad}
    assert {peft_name(n) for n in ours} == set(theirs) and len(ours) == 2 * (4 + 5 * 3 + 3 * 4 + 2 * 4 * experts)
    assert sum(".shared_expert." in n for n in ours) == 2 * 3 * 4
    with torch.no_grad():
        for n, p in ours.items():
            theirs[peft_name(n)].copy_(p)
    ids, labels = inputs()
    out = m(ids, labels=labels, loss_chunk=97)
    (out.total() / out.n_valid).backward()
    ref = pm(ids, labels=ids, output_router_logits=True).loss
    ref.backward()
    torch.testing.assert_close(out.total() / out.n_valid, ref.detach(), atol=0, rtol=1e-6)
    for n, p in ours.items():
        assert rel(p.grad, theirs[peft_name(n)].grad) < 2e-4, (n, rel(p.grad, theirs[peft_name(n)].grad))


def test_the_adapter_folder_loads_in_peft(tmp_path):
    """lora.save's PEFT folder for a Qwen3.5-MoE with adapters on every projection it takes (the shared expert's
    among them) and on its routed experts loads with peft.PeftModel.from_pretrained over transformers'
    Qwen3_5MoeForCausalLM of the base and gives our logits (fp32, within 1e-5); the merged export (each expert's
    delta added to its weights) loads alone with the same."""
    from million import lora
    from test_qwen3_5 import assert_exports_load
    pm = assert_exports_load(tmp_path, lambda: make_model(torch.float32, cfg()), lora.TARGETS + (lora.EXPERTS,))
    names = [n for n, _ in pm.named_parameters() if "lora_A" in n]
    assert sum(".shared_expert." in n for n in names) == 3 * 4 and sum(".experts." in n for n in names) == 2 * 4
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.gpu
def test_bf16_on_the_gpu_matches_fp32_on_the_cpu():
    """The tiny Qwen3.5-MoE in bf16 on the GPU (the experts on torch._grouped_mm, the DeltaNet rule on fla where it
    runs, else the torch rule) against the same weights in fp32 on the CPU: the loss with its load-balancing term
    within 1e-2 relative, each gradient within 5e-2 in norm (bf16 end to end; a token whose top-3 flips between
    the two moves its experts' gradients, which the 10x routers keep rare)."""
    from million.deltanet import resolve_kernel
    from test_fa4 import rel
    ids, labels = inputs()
    got = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        kernel = resolve_kernel("auto") if device == "cuda" else "torch"
        model = make_model(torch.float32, cfg(), mixer=DeltaNetMixer(kernel=kernel)).to(device, dtype)
        out = step(model, ids.to(device), labels.to(device))
        got[device] = (out.total().item(), {n: g.float().cpu() for n, g in grads(model).items()})
    (l0, g0), (l1, g1) = got["cpu"], got["cuda"]
    worst = max((rel(g1[n], g0[n]), n) for n in g0)
    print(f"loss {l0:.6f} vs {l1:.6f}, worst gradient {worst[0]:.1e} ({worst[1]})")
    assert abs(l1 - l0) / abs(l0) < 1e-2 and worst[0] < 5e-2, (l0, l1, worst)


def test_a_bad_expert_count_is_refused(tmp_path):
    d = {**cfg().to_hf_dict(), "num_experts": 2, "num_experts_per_tok": 3, "_name_or_path": "me/bad"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="^me/bad: Qwen3.5-MoE needs num_experts >= num_experts_per_tok >= 1, "
                                         "got 2 and 3$"):
        read_config(str(tmp_path))
