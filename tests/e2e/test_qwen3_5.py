"""train.py end to end on a Qwen3.5 config.json under torchrun (CPU, gloo): cp 2 gives cp 1's losses and grad norms,
for one sequence and for packed documents with LoRA on the DeltaNet projections, and --save_dir exports a folder
that transformers loads as Qwen3_5ForCausalLM with our logits. qwen3_5.py against transformers, PEFT and itself
in-process and in gloo worlds: tests/test_qwen3_5.py.

    python -m pytest tests/e2e/test_qwen3_5.py -q
"""
import json

import torch

from .test_train import run, same_steps


def qwen3_5_folder(tmp_path, **shape):
    """A folder with only a tiny Qwen3.5 config.json, written by transformers' config class: random init. 3 DeltaNet
    layers and 1 attention layer, vocabulary 257 (the demo's byte tokenizer); `shape` overrides the sizes."""
    from transformers import Qwen3_5TextConfig
    folder = tmp_path / "qwen3_5"
    Qwen3_5TextConfig(**{**dict(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=10,
                                max_position_embeddings=4096, initializer_range=0.05), **shape}).save_pretrained(folder)
    return str(folder)


def assert_loads_in_transformers(folder):
    """transformers loads the export as Qwen3_5ForCausalLM and gives our model's logits (fp32, within 2e-6)."""
    from transformers import AutoModelForCausalLM
    from million.qwen3_5 import from_pretrained
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(0, 257, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, from_pretrained(folder, torch.float32).logits(ids),
                                   atol=2e-6, rtol=1e-5)


def test_train_py_trains_qwen3_5_at_cp_1_and_2_and_exports_it(tmp_path):
    """One 264-token sequence a step (zigzag chunks of 66 at cp 2): cp 2, with every block's input offloaded and the
    attention layer's output kept, gives cp 1's losses within 1e-5 and grad norms within 1e-4; the loss falls; each
    run's export loads in transformers."""
    model = qwen3_5_folder(tmp_path)
    cp1 = run(tmp_path, 1, "--model", model, "--cp", "1", "--save_dir", str(tmp_path / "out1"))
    cp2 = run(tmp_path, 2, "--model", model, "--cp", "2", "--offload", "true", "--keep_attention", "true",
              "--save_dir", str(tmp_path / "out2"))
    same_steps(cp1, cp2)
    assert cp1[-1]["loss"] < cp1[0]["loss"]
    assert cp2[0]["host_pinned_gib"] > 0  # the offload ran
    for out in ("out1", "out2"):
        assert json.loads((tmp_path / out / "config.json").read_text())["model_type"] == "qwen3_5_text"
        assert_loads_in_transformers(str(tmp_path / out))


def test_data_parallel_and_context_parallel_together(tmp_path):
    """4 ranks as 2 data-parallel groups of a cp 2 ring: the DeltaNet state and conv history cross only the ranks of
    a ring (its cp group, not the world), so the run equals one rank accumulating the same 2 windows."""
    model = qwen3_5_folder(tmp_path)
    one = run(tmp_path, 1, "--model", model, "--cp", "1", "--grad_accum", "2")
    dp2cp2 = run(tmp_path, 4, "--model", model, "--cp", "2")
    same_steps(one, dp2cp2)
    assert one[0]["num_tokens"] == 2 * 264


def test_train_py_trains_qwen3_5_moe_at_cp_1_and_2_and_exports_it(tmp_path):
    """A tiny Qwen3.5-MoE (6 experts, top 2, a shared expert; the load-balancing loss on): cp 2 with the blocks
    offloaded and the experts tiled gives cp 1's losses, load-balancing terms and grad norms; the loss falls; the
    export loads in transformers as Qwen3_5MoeForCausalLM with our logits."""
    import pytest
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig
    from million.qwen3_5 import from_pretrained
    model = tmp_path / "qwen3_5_moe"
    Qwen3_5MoeTextConfig(vocab_size=257, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=12, linear_value_head_dim=10, num_experts=6, num_experts_per_tok=2,
                         moe_intermediate_size=24, shared_expert_intermediate_size=40, output_router_logits=True,
                         router_aux_loss_coef=0.1, max_position_embeddings=4096,
                         initializer_range=0.05).save_pretrained(model)
    cp1 = run(tmp_path, 1, "--model", str(model), "--cp", "1", "--save_dir", str(tmp_path / "out"))
    cp2 = run(tmp_path, 2, "--model", str(model), "--cp", "2", "--offload", "true", "--mlp_tile", "50")
    same_steps(cp1, cp2)
    for a, b in zip(cp1, cp2):  # near-uniform routing at this init: aux ~ top_k = 2, so coef * aux ~ 0.2
        assert a["aux_loss"] > 0.05 and a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5), (a, b)
    assert cp1[-1]["loss"] < cp1[0]["loss"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    ids = torch.randint(0, 257, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, from_pretrained(str(tmp_path / "out"), torch.float32).logits(ids),
                                   atol=2e-6, rtol=1e-5)


def test_packed_documents_with_lora_at_cp_1_and_2(tmp_path):
    """Prompt/completion rows packed as documents (the DeltaNet state and conv restart at each; at cp 2 the chunks
    go to ranks by documents.cp_layout, the layout the mixer is given) with LoRA on the DeltaNet and attention
    projections: cp 2 gives cp 1's losses; the merged export loads in transformers."""
    rows = tmp_path / "rows.jsonl"
    gen = torch.Generator().manual_seed(3)
    with open(rows, "w") as fh:
        for i in range(60):
            n = int(torch.randint(10, 70, (1,), generator=gen))
            fh.write(json.dumps({"prompt": f"row {i}: " + "ab" * (n // 4), "completion": " " + "xyz" * (n // 3)}) + "\n")
    model = qwen3_5_folder(tmp_path)
    lora = ["--packing", "docs", "--data", str(rows), "--lora_rank", "4", "--lr", "1e-2",
            "--lora_targets", "in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj,q_proj,v_proj,down_proj"]
    cp1 = run(tmp_path, 1, "--model", model, "--cp", "1", *lora)
    cp2 = run(tmp_path, 2, "--model", model, "--cp", "2", *lora, "--merge_lora", "true",
              "--save_dir", str(tmp_path / "merged"))
    same_steps(cp1, cp2)
    assert all(r["docs"] > 3 for r in cp1), [r["docs"] for r in cp1]
    assert_loads_in_transformers(str(tmp_path / "merged"))


def test_qlora_killed_and_resumed_continues_exactly(tmp_path):
    """--lora_rank 4 --quantize nf4 on a Qwen3.5 at cp 2 (every block projection in NF4: the gated attention's, the
    DeltaNet layers' and the MLPs'; a shape whose projections split into NF4's blocks): killed mid-step and
    relaunched, it gives the uninterrupted run's losses and grad norms bit for bit (the NF4 base rebuilt from the
    model on resume); the merged export loads in transformers."""
    from .test_lora import killed_and_resumed
    model = qwen3_5_folder(tmp_path, hidden_size=128, linear_num_value_heads=8, linear_key_head_dim=16,
                           linear_value_head_dim=8)
    killed_and_resumed(tmp_path, ["--model", model])
    assert_loads_in_transformers(str(tmp_path / "merged"))


def test_fit_auto_plans_qwen3_5(tmp_path):
    """--fit auto on a Qwen3.5 (capacities given, on CPU): train.py prints the plan plan.py makes for the hybrid
    and trains with its levers; the offloaded blocks hold on the host what plan.host_bytes counts."""
    from million import plan
    from million.qwen3_5 import read_config
    from .test_plan import run_train
    folder = qwen3_5_folder(tmp_path)
    s = plan.Shape.of(read_config(folder), 2048, 1, 1, 1, act_bytes=4, loss_chunk=512,  # as run_train runs it:
                      deltanet_kernel="torch")                                             # the CPU's rule
    assert s.attn_layers == 1 and s.dn[:4] == (2, 4, 12, 10)
    gpu = plan.predict(s, plan.Levers(2, 4)).gpu_gib / plan.GPU_MARGIN * 1.0001  # fits with 2 of 4 blocks offloaded
    lv, cost = plan.choose(s, gpu, 100)
    assert lv.offload_layers >= 2  # (offloading costs no predicted time here: the lowest peak wins)
    p = run_train(tmp_path, "--model", folder, "--gpu_mem_gib", f"{gpu:.6f}", "--host_mem_gib", "100")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fit: " in p.stdout and plan.describe(lv, cost, s).split(" -> ")[0] in p.stdout, p.stdout
    cfg = json.load(open(tmp_path / "run" / "train_config.json"))
    assert cfg["offload_layers"] == lv.offload_layers and cfg["keep_attention_layers"] == lv.keep_attention_layers
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # what the offloaded blocks hold on the host (unpinned on a CPU): every block's input, and the attention
    # layer's output and lse, not the DeltaNet layers'
    assert rows[-1]["host_pinned_gib"] * 2**30 == plan.host_bytes(s, lv, pinned=False)


def test_deltanet_tile_trains_the_same_steps(tmp_path):
    """--deltanet_tile 100 (pieces of 100 tokens of the 264-token sequence, under checkpointing) gives the whole
    layer's losses and grad norms; with --cp 2 it is refused in one line."""
    model = qwen3_5_folder(tmp_path)
    whole = run(tmp_path, 1, "--model", model, "--cp", "1")
    pieces = run(tmp_path, 1, "--model", model, "--cp", "1", "--deltanet_tile", "100")
    same_steps(whole, pieces)
    p, _ = run(tmp_path, 2, "--model", model, "--cp", "2", "--deltanet_tile", "100", check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode != 0 and errors == ["error: --deltanet_tile 100 needs --cp 1 (one device a sequence): under "
                                            "context parallelism the DeltaNet state comes from the ranks' span "
                                            "summaries"], p.stderr[-2000:]


def test_the_guide_s_qwen3_5_demos_train(tmp_path):
    """The guide's CPU commands on the example folders (examples/tiny-qwen3_5 and -moe: a config.json each), as
    written but for --max_steps 3 and the run folder: each trains from random weights and its loss falls."""
    import os
    import re
    import subprocess
    import sys
    from .test_train import ROOT
    guide = open(os.path.join(ROOT, "million", "README.md"), encoding="utf-8").read()
    commands = re.findall(r"^(torchrun .*--model examples/tiny-qwen3_5\S*)", guide, flags=re.M)
    assert len(commands) == 2, commands
    for i, command in enumerate(commands):
        args = command.split("#")[0].split()[1:]  # torchrun's arguments
        out = tmp_path / f"run{i}"
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args, "--max_steps", "3", "--out_dir",
                            str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (command, p.stderr[-3000:])
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        assert len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"], rows
