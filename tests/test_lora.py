"""lora.py against PEFT (the independent reference): the same adapter values on a tiny Qwen3 give PEFT's loss,
logits and every adapter's gradient in fp32, in one process with every memory lever on and off, and under FSDP2
with the ring at cp 2 and 4, dp 2 and grad_accum 2, on plain and packed windows; the frozen base never moves;
the exports load in PEFT and transformers; QLoRA's NF4 against torchao and a formula, and its loss against the
dequantized model's (train.py killed and resumed with QLoRA: tests/e2e/test_lora.py). CPU, about 40 s:

    python -m pytest tests/test_lora.py -q
"""
import json
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loss as L
from million import lora
import parallel
from million import documents
from million.hf import save_pretrained
from model import Qwen3, Qwen3Config
from parallel import RingAttention, cp_shard
from test_fa4 import rel
from test_ring import run_ranks

# peft (a test dependency: the reference LoRA) and transformers are imported where they are used: the
# ranks import this file and need neither (their imports take longer than a rank's work)

RANK, ALPHA = 4, 6.0   # alpha / rank = 1.5, so that a scale left out would show
T = 40                 # window: chunks of 5 at cp 4
DOCS = (11, 17, 12)    # a packed window's documents


def tiny(**kw):
    """2 layers, 5 query heads over 1 KV head, odd widths (40, 72), vocab 97."""
    d = dict(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=5,
             num_key_value_heads=1, head_dim=8, rope_theta=10000.0)
    return Qwen3Config.tiny(**{**d, **kw})


@pytest.fixture(scope="module")
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def random_model(cfg, seed=0):
    """A float32 Qwen3 with init_weights' draw from seed."""
    m = Qwen3(cfg)
    m.init_weights(torch.Generator().manual_seed(seed))
    return m


def peft_name(name):
    """Our adapter's name -> its parameter in a PeftModel."""
    return "base_model.model.model." + name.replace(".weight", ".default.weight")


def adapted(m, targets=lora.TARGETS, seed=1, quantize=""):
    """m with adapters whose A and B are both random (seeded), so that every gradient is non-zero."""
    lora.apply(m, RANK, ALPHA, targets, quantize=quantize)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if lora.is_adapter(n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m


def model_and_peft(folder, targets=lora.TARGETS, cfg=None, seed=0):
    """(ours, PEFT's) on the same base weights (random, float32) and the same adapter values."""
    import peft
    import transformers
    base = random_model(cfg or tiny(), seed)
    save_pretrained(base, str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets),
                                                 lora_dropout=0.0))
    m = adapted(base, targets)
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            if lora.is_adapter(n):
                params[peft_name(n)].copy_(p)
    return m, pm


def labels_of(ids, doc_lens):
    """Next-token labels inside each document: -100 at each document's last token."""
    labels = torch.cat([ids[1:], ids[:1]]).clone()
    labels[torch.tensor(doc_lens).cumsum(0) - 1] = -100
    return labels


def windows(n, vocab=97):
    """n windows of T tokens (seeded): even ones one sequence, odd ones the packed documents DOCS. -> [(ids,
    labels, positions, doc_lens)]."""
    gen, out = torch.Generator().manual_seed(5), []
    for i in range(n):
        ids = torch.randint(0, vocab, (T,), generator=gen)
        docs = DOCS if i % 2 else (T,)
        pos = torch.cat([torch.arange(d) for d in docs])
        out.append((ids, labels_of(ids, docs), pos, docs if len(docs) > 1 else None))
    return out


def peft_reference(pm, wins):
    """PEFT's mean NLL over every trained token of the windows, each document alone from position 0 (the oracle of
    packed windows), and the adapters' gradients of it under our names."""
    pm.zero_grad(set_to_none=True)
    total, count = 0.0, sum(int((lab != -100).sum()) for _, lab, _, _ in wins)
    for ids, labels, _, docs in wins:
        start = 0
        for d in docs or (T,):
            logits = pm(ids[None, start:start + d]).logits[0]
            total = total + F.cross_entropy(logits, labels[start:start + d], ignore_index=-100, reduction="sum")
            start += d
    (total / count).backward()
    grads = {n.replace("base_model.model.model.", "").replace(".default", ""): p.grad
             for n, p in pm.named_parameters() if p.requires_grad}
    return (total / count).detach(), grads


def ours(m, wins):
    """Our mean NLL over the windows (each its own micro-batch, as --grad_accum runs them) and every gradient."""
    m.zero_grad(set_to_none=True)
    count = sum(int((lab != -100).sum()) for _, lab, _, _ in wins)
    total = 0.0
    for ids, labels, pos, docs in wins:
        s, _ = m(ids[None], pos[None], labels[None], loss_chunk=9, doc_lens=docs)
        (s / count).backward()
        total += s.detach()
    return total / count, {n: p.grad for n, p in m.named_parameters()}


def assert_matches(loss, grads, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert set(ref_grads) == {n for n, g in grads.items() if g is not None}  # the adapters have gradients alone
    for n, g in ref_grads.items():  # the float32 floor: ~1e-6 measured
        assert rel(grads[n], g) < 1e-5, (n, rel(grads[n], g))


LEVERS = {  # name: (Qwen3.set_levers' arguments, blocks (the last ones) that keep gate's and up's outputs)
    "none": (dict(recompute=False), 0),
    "all": (dict(recompute=True, offload=True, keep_attention=True, mlp_tile=7), 1),  # one block keeps, one not
    "kept-mlp-no-recompute": (dict(recompute=False), 2),  # kept by an ordinary autograd node, in one tile
}


def levered(m, name):
    """m with the levers LEVERS[name]."""
    args, kept_mlp = LEVERS[name]
    lora.keep_mlp(m.set_levers(**args), kept_mlp)
    return m


@pytest.mark.parametrize("levers", list(LEVERS))
@pytest.mark.parametrize("targets", [lora.TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj")],
                         ids=["all", "qv", "o-down"])
def test_matches_peft(tmp_path, group_of_one, levers, targets):
    """One process, two micro-batches (one sequence, one packed window): loss, logits and every adapter's gradient
    equal PEFT's in fp32; the recomputed blocks, offload, kept attention and the tiled MLP change nothing."""
    m, pm = model_and_peft(tmp_path, targets)
    levered(m, levers)
    m.attn_fn = RingAttention(group_of_one, schedule=documents.schedule)  # kept attention needs fwd/bwd halves
    wins = windows(2)
    assert_matches(*ours(m, wins), *peft_reference(pm, wins))
    ids = wins[0][0][None]
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), pm(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_base_never_moves_and_the_head_makes_no_gradient(tmp_path, monkeypatch):
    """train.py's optimizer over a LoRA model holds the adapters alone: after steps with weight decay every base
    weight is bit for bit what it was, the adapters moved, and the chunked loss never formed the head's weight
    gradient (need_dw false)."""
    import train
    from million import config
    m = adapted(random_model(tiny()))
    m.attn_fn = documents.masked_attention  # one device, packed windows: the naive document mask
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = train.make_optimizer(config.TrainConfig(lr=1e-2, weight_decay=0.1, device="cpu"), m)
    assert len(opt.state) == sum(lora.is_adapter(n) for n in start) == 2 * 7 * 2
    need_dw, apply = [], L._ChunkedNLL.apply
    monkeypatch.setattr(L._ChunkedNLL, "apply", lambda *a: need_dw.append(a[-1]) or apply(*a))
    for ids, labels, pos, docs in windows(3):
        s, n = m(ids[None], pos[None], labels[None], doc_lens=docs)
        (s / n).backward()
        parallel.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert need_dw == [False] * 3
    for n, p in m.named_parameters():
        assert torch.equal(p, start[n]) != lora.is_adapter(n), n


def test_the_frozen_embedding_output_is_not_held_to_the_end_of_the_backward(monkeypatch):
    """The embedding's output starts the graph (lora.InputEmbedding) without becoming a leaf: with every block
    offloaded it is freed once the forward is done (a leaf would stay until the backward ends, [T, hidden] at the
    GPU's peak: 1 GiB at 131k on Qwen3-8B, bench/NOTES.md), and the first block's adapters still get gradients."""
    m = levered(adapted(random_model(tiny())), "all")
    made, embedding = [], F.embedding
    monkeypatch.setattr(lora.F, "embedding", lambda *a, **k: made.append(embedding(*a, **k)) or made[-1])
    ids, labels, pos, docs = windows(1)[0]
    s, n = m(ids[None], pos[None], labels[None])
    alive = weakref.ref(made.pop())
    assert alive() is None
    (s / n).backward()
    first = [p.grad for name, p in m.named_parameters() if name.startswith("layers.0.") and lora.is_adapter(name)]
    assert len(first) == 14 and all(g is not None and g.abs().sum() > 0 for g in first)


def test_kept_mlp_outputs_change_nothing_but_the_recompute(monkeypatch):
    """lora.keep_mlp: blocks that keep gate's and up's outputs give the loss and gradients bit for bit of blocks
    that recompute them, without running those two projections again in the backward; what is kept waits on the
    module from the recomputed forward to its backward and is let go there; an evaluation (eval mode) keeps
    nothing."""
    def run(kept):
        m = lora.keep_mlp(adapted(random_model(tiny())).set_levers(recompute=True, offload=True, mlp_tile=7), kept)
        calls, linear = [], F.linear  # the weights of the x W^T products (the backward's recompute runs them)
        monkeypatch.setattr(lora.F, "linear", lambda x, w, *a: calls.append(w.shape) or linear(x, w, *a))
        s, n = m(*(t[None] for t in windows(1)[0][:3]))
        mlps = [b.mlp for b in m.layers]
        held = [mlp.kept is not None for mlp in mlps]
        forward = len(calls)
        (s / n).backward()
        assert all(mlp.kept is None for mlp in mlps)
        gate_up = sum(shape == (72, 40) for shape in calls[forward:])  # the frozen gate and up weights, [I, H]
        monkeypatch.undo()
        return s, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, held, gate_up, m
    loss, grads, held, gate_up, _ = run(0)
    loss2, grads2, held2, gate_up2, m = run(2)
    assert held == [False, False] and held2 == [True, True]
    assert gate_up == 2 * 2 * 6 and gate_up2 == 0  # 2 blocks x (gate, up) x 6 tiles of 7 rows in 40
    assert torch.equal(loss, loss2) and grads.keys() == grads2.keys()
    for n in grads:
        assert torch.equal(grads[n], grads2[n]), n
    m.eval()
    with torch.no_grad():
        m(windows(1)[0][0][None])
    assert all(b.mlp.kept is None for b in m.layers)


# --- FSDP2 and the ring: cp 2 and 4, dp 2, grad_accum 2 -------------------------------------------------

CASES = {  # world: [(cp, micro-batches per rank, levers)], each case a model of its own on the same ranks
    2: [(2, 1, "all")],
    4: [(4, 1, "none"), (2, 2, "all")],  # the second: cp 2 x dp 2, grad_accum 2
}


def _rank_main(rank, world, port, out_dir):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = []
        for cp, accum, levers in CASES[world]:
            mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
            m = levered(adapted(random_model(tiny())), levers)
            m.attn_fn = RingAttention(mesh.get_group("cp"), schedule=documents.schedule)
            parallel.shard_model(m, DeviceMesh.from_group(dist.group.WORLD, "cpu"), param_dtype=torch.float32)
            wins = windows(world // cp * accum)
            count = sum(int((lab != -100).sum()) for _, lab, _, _ in wins)
            d, r = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
            total = torch.zeros(())
            for ids, labels, pos, docs in wins[d * accum:(d + 1) * accum]:  # this data-parallel group's windows
                layout = documents.cp_layout(cp, docs)
                ids, labels, pos = (cp_shard(x[None], 1, r, cp, layout) for x in (ids, labels, pos))
                s, _ = m(ids, pos, labels, loss_chunk=4, doc_lens=docs)
                (s / count).backward()
                total += s.detach()
            dist.all_reduce(total)
            results.append((total / count, {n: p.grad.full_tensor() for n, p in m.named_parameters()
                                            if p.grad is not None}))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", list(CASES))
def test_fsdp2_and_the_ring_match_peft(tmp_path, world):
    """FSDP2 over every rank (frozen and trained parameters in one unit, the root all frozen), the ring over each
    context-parallel group, data parallel over the rest (cp 2; cp 4; cp 2 x dp 2 with grad_accum 2): the loss
    and the gathered adapter gradients equal PEFT's over the same windows (plain and packed)."""
    results, *_ = run_ranks(world, tmp_path, main=_rank_main)
    _, pm = model_and_peft(tmp_path / "hf")
    for (cp, accum, _), (loss, grads) in zip(CASES[world], results, strict=True):
        assert_matches(loss, grads, *peft_reference(pm, windows(world // cp * accum)))


# --- the exports -------------------------------------------------------------------------------------

def test_the_adapter_folder_loads_in_peft_and_the_merged_model_in_transformers(tmp_path):
    """lora.save writes PEFT's folder (its key names, its config): PeftModel.from_pretrained over the base gives
    our logits. Merged, it is a plain checkpoint that transformers loads alone, with the same logits."""
    import peft
    import transformers
    base = random_model(tiny())
    save_pretrained(base, str(tmp_path / "base"))
    m = adapted(base, ("q_proj", "k_proj", "down_proj"))
    sd = m.state_dict()
    lora.save(str(tmp_path / "adapter"), m, sd, str(tmp_path / "base"))
    lora.save(str(tmp_path / "merged"), m, sd, str(tmp_path / "base"), merge=True)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["target_modules"] == ["down_proj", "k_proj",
                                                                                        "q_proj"]
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 2 * 3 * 2
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m.logits(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))
        torch.testing.assert_close(pm(ids).logits, want, rtol=1e-5, atol=1e-5)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)


# --- QLoRA: NF4 ----------------------------------------------------------------------------------------

NF4_LEVELS = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379,
              0.4407, 0.5626, 0.7230, 1.0]  # QLoRA's NormalFloat4 (arXiv:2305.14314, appendix E), as torchao rounds it


def nf4_formula(w, block=64, scaler_block=256):
    """NF4 with double quantization, written out: each weight's nearest level after dividing by its block's absmax;
    the absmaxes, less their mean, quantized to int8 per scaler block; a weight comes back as level x absmax."""
    levels = torch.tensor(NF4_LEVELS, dtype=w.dtype)
    blocks = w.reshape(-1, block)
    absmax = blocks.abs().amax(1)                                                  # [n]
    centred = absmax - absmax.mean()
    groups = centred.view(-1, scaler_block)
    factor = 256 / (2 * groups.abs().amax(1, keepdim=True))                        # [n / scaler_block, 1]
    q = (groups * factor).round().clamp(-128, 127)
    scales = (q / factor).flatten() + absmax.mean()
    codes = ((blocks / absmax[:, None])[..., None] - levels).abs().argmin(-1)     # [n, block]
    return (levels[codes] * scales[:, None]).view(w.shape)


@pytest.mark.parametrize("shape", [(256, 64), (160, 64)])
def test_nf4_round_trip_is_torchaos_and_the_formula(shape):
    """lora.nf4 is torchao's NF4Tensor; its dequantized weight equals the formula (for 160 x 64, 160 blocks: the
    scales quantized per 32), and no weight moves further than the two roundings allow."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    q = lora.nf4(w)
    assert type(q).__name__ == "NF4Tensor" and q.quantized_data.numel() == w.numel() // 2
    blocks = w.numel() // 64
    scaler = 256 if blocks % 256 == 0 else 32
    assert q.scaler_block_size == scaler
    assert torch.equal(q.get_original_weight(), lora.torchao_to_nf4()(w, 64, scaler).get_original_weight())
    torch.testing.assert_close(q.get_original_weight(), nf4_formula(w, 64, scaler), rtol=1e-6, atol=1e-9)
    # the bound: half the widest gap between levels (-1 to -0.6962) of the block's absmax, plus half an int8 step
    # of the absmax's own quantization (its group's largest distance from the mean, over 128)
    gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
    absmax = w.reshape(-1, 64).abs().amax(1)
    step = (absmax - absmax.mean()).view(-1, scaler).abs().amax(1).repeat_interleave(scaler) / 128
    err = (q.get_original_weight() - w).reshape(-1, 64).abs().amax(1)
    assert (err <= (gap / 2 * absmax + step / 2) * (1 + 1e-5)).all() and (err > gap / 4 * absmax).any()
    with pytest.raises(ValueError, match="multiple of 1024"):
        lora.nf4(torch.randn(72, 40))


def test_qlora_is_lora_on_the_dequantized_model(group_of_one):
    """The NF4 model (every block projection an NF4Tensor, left out of the state dict) gives the loss, logits and
    adapter gradients of the float model whose projections are the dequantized weights, levers on."""
    cfg = tiny(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    q = lora.quantize(adapted(random_model(cfg), quantize="nf4"))
    d = adapted(random_model(cfg))  # the same base and adapters, in float32
    with torch.no_grad():
        for name, m in q.named_modules():
            if isinstance(m, lora.LoRALinear):
                d.get_submodule(name).weight.copy_(m.weight.get_original_weight())
    assert not any(n.endswith("proj.weight") for n in q.state_dict()) and "NF4" in lora.describe(q)
    assert all(type(m.weight).__name__ == "NF4Tensor" for m in q.modules() if isinstance(m, lora.LoRALinear))
    for m in (q, d):
        levered(m, "all")
        m.attn_fn = RingAttention(group_of_one, schedule=documents.schedule)
    wins = windows(2)
    loss, grads = ours(q, wins)
    ref_loss, ref_grads = ours(d, wins)
    assert_matches(loss, grads, ref_loss, {n: g for n, g in ref_grads.items() if g is not None})
    with torch.no_grad():
        ids = wins[0][0][None]
        torch.testing.assert_close(q.logits(ids), d.logits(ids), rtol=1e-6, atol=1e-6)


# --- Qwen3-MoE, flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tile", [0, 5])
def test_moe_takes_attention_and_expert_adapters(tmp_path, tile):
    """On Qwen3-MoE the adapters on attention and on the routed experts (PEFT's target_parameters
    mlp.experts.gate_up_proj and mlp.experts.down_proj) match PEFT's, fp32: the loss, and every adapter's gradient
    (the experts' A and B, shared out among them, included), whole and with the MoE blocks in tiles of 5 rows
    under recompute. In float64: PEFT adds each expert's delta to its weight where we run the adapters beside it,
    and in float32 that alone moves a gradient by up to 1.1e-5; in float64 the worst is 1.4e-6 (transformers' router
    takes its softmax in float32). Adapters on the MLP are refused in one line, as experts on a dense model."""
    import peft
    import transformers
    from test_moe import moe_cfg, random_moe, shifted
    base = random_moe(moe_cfg()).double()
    save_pretrained(base, str(tmp_path))
    with pytest.raises(ValueError, match=r"^--lora_targets gate_proj,up_proj,down_proj,in_proj_qkv,.*,out_proj: not "
                                         r"projections of Qwen3-MoE \(its MLP is its routed experts\); pass "
                                         r"--lora_targets q_proj,k_proj,v_proj,o_proj \(attention\), with ,experts "
                                         r"to adapt the experts too$"):
        lora.apply(random_moe(moe_cfg()), RANK, ALPHA)
    with pytest.raises(ValueError, match=r"^--lora_targets experts: this model has no routed experts \(a dense "
                                         r"model\); drop it$"):
        lora.apply(random_model(tiny()), RANK, ALPHA, lora.ATTENTION + (lora.EXPERTS,))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64,
                                                           experts_implementation="eager")  # its loop: any dtype
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(lora.ATTENTION),
                                                 target_parameters=["mlp.experts.gate_up_proj",
                                                                    "mlp.experts.down_proj"]))
    m = adapted(base, lora.ATTENTION + (lora.EXPERTS,))
    if tile:
        m.set_levers(recompute=True, mlp_tile=tile)
    params = dict(pm.named_parameters())
    ours = {n for n, _ in m.named_parameters() if lora.is_adapter(n)}
    assert {peft_name(n) for n in ours} == {n for n, p in params.items() if p.requires_grad}
    assert sum(".experts." in n for n in ours) == 4 * sum(m.cfg.sparse(i) for i in range(m.cfg.num_hidden_layers))
    with torch.no_grad():
        for n in ours:
            params[peft_name(n)].copy_(m.get_parameter(n))
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(1))
    out = pm(ids, labels=ids)
    out.loss.backward()
    s, n = m(ids, labels=shifted(ids), loss_chunk=9)
    (s / n).backward()
    ref = {k.replace("base_model.model.model.", "").replace(".default", ""): p.grad
           for k, p in pm.named_parameters() if p.requires_grad}
    assert_matches((s / n).detach(), {k: p.grad for k, p in m.named_parameters()}, out.loss.detach(), ref)


@pytest.mark.parametrize("targets", [lora.ATTENTION + (lora.EXPERTS,), ("q_proj", "v_proj")], ids=["experts", "qv"])
def test_qlora_on_a_mixture_of_experts_is_lora_on_the_dequantized_model(targets):
    """QLoRA on Qwen3-MoE: the routed experts' stacked weights become NF4Tensors beside the projections', adapted
    (LoRAExperts' adapters) or not; none is left in the state dict. The loss and every adapter's gradient are those
    of the float model whose weights are the dequantized ones (1e-5, fp32), whole and with the MoE in tiles of 7 rows
    under recompute; the merged export holds the dequantized weights plus the adapters' deltas."""
    from test_moe import moe_cfg, random_moe, shifted
    cfg = moe_cfg(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)  # every weight a multiple of NF4's 1,024
    q = lora.quantize(adapted(random_moe(cfg), targets, quantize="nf4"))
    d = adapted(random_moe(cfg), targets)  # the same base and adapters, in float32
    nf4 = {f"{name}.{n}": w for name, m in q.named_modules() for n, w in m.named_buffers(recurse=False)
           if lora.is_nf4(w)}
    experts = [n for n in nf4 if ".mlp.experts." in n]
    # the 2 sparse layers' 3 stacked weights, the 3 layers' 4 attention projections, the dense layer's MLP
    assert len(experts) == 2 * 3 and len(nf4) == 2 * 3 + 3 * 4 + 3
    assert not set(nf4) & set(q.state_dict()) and "NF4" in lora.describe(q)
    with torch.no_grad():
        for n, w in nf4.items():
            module, _, name = n.rpartition(".")
            if n in experts:  # [E, out, in] from the NF4Tensor's [E x out, in]: each expert's own, within NF4's error
                dense = q.get_submodule(module).base(name)
                assert all(rel(a, b) < 0.12 for a, b in zip(dense, d.get_parameter(n))), rel(dense, d.get_parameter(n))
                d.get_parameter(n).copy_(dense)
            else:
                d.get_parameter(n).copy_(w.get_original_weight())
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(1))
    for tile in (0, 7):
        results = []
        for m in (q, d):
            m.set_levers(recompute=bool(tile), mlp_tile=tile)
            m.zero_grad(set_to_none=True)
            s, n = m(ids, labels=shifted(ids), loss_chunk=9)
            (s / n).backward()
            results.append(((s / n).detach(), {k: p.grad for k, p in m.named_parameters()}))
        (loss, grads), (ref_loss, ref_grads) = results
        assert_matches(loss, grads, ref_loss, {k: g for k, g in ref_grads.items() if g is not None})
    merged, ref = (lora.merged_state_dict(m, m.state_dict(), torch.float32) for m in (q, d))
    assert merged.keys() == ref.keys() and all(torch.equal(merged[k], ref[k]) for k in ref)
    # train.py's order: built on meta, to_empty leaves the weights that wait for NF4 there (never whole in bf16 on a
    # GPU), and quantize takes each out of the full state dict: the same NF4 as quantizing the loaded model
    from million.moe import Qwen3MoE
    with torch.device("meta"):
        w = lora.apply(Qwen3MoE(cfg), RANK, ALPHA, targets, quantize="nf4")
    w.to_empty(device="cpu")
    assert all(b.is_meta for n, b in w.named_buffers() if n in nf4) and not any(p.is_meta for p in w.parameters())
    with pytest.raises(ValueError, match="waits on meta for its weights: pass the full state dict"):
        lora.quantize(w)  # one process without the weights: never NF4 of uninitialised memory
    sd = random_moe(cfg).state_dict()
    lora.quantize(w, sd, "cpu")
    assert not set(nf4) & set(sd) and all(torch.equal(w.get_buffer(n).get_original_weight(),
                                                      nf4[n].get_original_weight()) for n in nf4)
    # train.py's: a float32 model, the frozen base in bf16 (--dtype) until quantized, the adapters in float32
    m = lora.apply(random_moe(cfg), RANK, ALPHA, targets, base_dtype=torch.bfloat16, quantize="nf4")
    frozen = [(n, b.dtype) for n, b in m.named_buffers() if ".rotary" not in n] + [
        (n, p.dtype) for n, p in m.named_parameters() if not lora.is_adapter(n)]
    assert len(frozen) > len(nf4) and {d for _, d in frozen} == {torch.bfloat16}, frozen


def test_flags_are_checked_before_any_work(tmp_path):
    from million import config
    def error(**kw):
        with pytest.raises(SystemExit) as e:
            config.check_config(config.TrainConfig(device="cpu", seq_len=256, **kw), 1)
        return str(e.value.code)
    assert "--lora_rank" in error(quantize="nf4")
    assert "--lora_rank" in error(merge_lora=True)
    assert "comma list of q_proj" in error(lora_rank=8, lora_targets="q_proj,lm_head")
    assert "use nf4" in error(lora_rank=8, quantize="int8")
    assert "LoRA lever" in error(keep_mlp_layers=4) and "count blocks" in error(lora_rank=8, keep_mlp_layers=-2)
    config.check_config(config.TrainConfig(device="cpu", seq_len=256, lora_rank=8, quantize="nf4"), 1)  # passes
    # what lora.apply would refuse, refused before start-up: experts on a dense Qwen3, MLP names on a Qwen3-MoE
    assert error(model="tiny", lora_rank=8, lora_targets="q_proj,experts") == \
        "error: --lora_targets experts: this model has no routed experts (a dense model); drop it"
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert error(model=str(folder), lora_rank=8).startswith("error: --lora_targets gate_proj,up_proj,down_proj: not")
    config.check_config(config.TrainConfig(device="cpu", seq_len=256, model=str(folder), lora_rank=8,
                                           lora_targets="q_proj,experts"), 1)  # passes
    assert lora.apply(random_model(tiny()), 8).layers[0].mlp.up_proj.scaling == 2.0  # alpha 0: 2 x rank


def test_a_hub_ids_targets_are_checked_once_it_is_read(monkeypatch):
    """A hub id's config is read only once downloaded, on rank 0 (train.model_config, under survival.on_rank0):
    targets its model lacks stop the run there, in the same one line a local folder gets before start-up."""
    import dataclasses
    import huggingface_hub
    import train
    from million import config
    folder = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns: folder)  # the network
    cfg = config.TrainConfig(device="cpu", seq_len=256, model="Qwen/Qwen3.5-Tiny", yarn_factor=0, lora_rank=8,
                             lora_targets="q_proj,in_proj_qkv,experts")
    config.check_config(cfg, 1)  # a hub id: nothing to read yet
    with pytest.raises(SystemExit) as e:
        train.model_config(cfg)
    assert e.value.code == "error: --lora_targets experts: this model has no routed experts (a dense model); drop it"
    path, mcfg = train.model_config(dataclasses.replace(cfg, lora_targets="q_proj,in_proj_qkv"))
    assert path.endswith("tiny-qwen3_5") and mcfg.layer_types
