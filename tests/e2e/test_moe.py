"""train.py end to end on a Qwen3-MoE config.json under torchrun (CPU, gloo): cp 2 gives cp 1's losses,
load-balancing losses and grad norms. moe.py against transformers in-process and in gloo worlds: tests/test_moe.py.

    python -m pytest tests/e2e/test_moe.py -q
"""
import json

import pytest

from million import hf as H
from test_moe import moe_cfg


def test_train_py_runs_a_moe_config_at_cp_1_and_2(tmp_path):
    """A folder holding only a Qwen3-MoE config.json (random init) trains under torchrun on CPU; cp 2 gives cp
    1's losses, load-balancing losses and grad norms (the router counts are all-reduced over the cp group), each
    logged apart: `loss` the language model's, `aux_loss` coef * aux."""
    from .test_train import run, same_steps
    folder = tmp_path / "moe"
    folder.mkdir()
    cfg = moe_cfg(vocab_size=257, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                  mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=0.1, initializer_range=0.1)
    (folder / "config.json").write_text(json.dumps(H.config_to_dict(cfg)))
    cp1 = run(tmp_path, 1, "--model", str(folder), "--cp", "1")
    cp2 = run(tmp_path, 2, "--model", str(folder), "--cp", "2", "--mlp_tile", "50", "--tiled_mlp", "true")
    same_steps(cp1, cp2)
    assert cp1[-1]["loss"] < cp1[0]["loss"]
    for a, b in zip(cp1, cp2):  # near-uniform routing at this init: aux ~ top_k = 2, so coef * aux ~ 0.2
        assert a["aux_loss"] > 0.05 and a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5), (a, b)


def test_lora_on_the_experts_at_cp_1_and_2_exports_both_ways(tmp_path):
    """--lora_targets q_proj,v_proj,experts on a Qwen3-MoE config.json: cp 2 with the experts tiled and the blocks
    offloaded gives cp 1's losses and grad norms; cp 1's PEFT folder (its experts' adapters under PEFT's
    target_parameters) over the base the runs drew, and cp 2's merged export, give the same logits."""
    import peft
    import torch
    import transformers
    from million.moe import Qwen3MoE
    from .test_train import run, same_steps
    folder = tmp_path / "moe"
    folder.mkdir()
    cfg = moe_cfg(vocab_size=257, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, mlp_only_layers=[],
                  initializer_range=0.1)
    (folder / "config.json").write_text(json.dumps(H.config_to_dict(cfg)))
    lora = ["--model", str(folder), "--lora_rank", "8", "--lora_targets", "q_proj,v_proj,experts", "--lr", "1e-2"]
    cp1 = run(tmp_path, 1, *lora, "--cp", "1", "--save_dir", str(tmp_path / "adapter"))
    cp2 = run(tmp_path, 2, *lora, "--cp", "2", "--mlp_tile", "50", "--tiled_mlp", "true", "--offload", "true",
              "--merge_lora", "true", "--save_dir", str(tmp_path / "merged"))
    same_steps(cp1, cp2)
    assert cp1[-1]["loss"] < cp1[0]["loss"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    from safetensors.torch import load_file
    trained = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    experts_b = [t for n, t in trained.items() if ".experts." in n and "lora_B" in n]
    assert len(experts_b) == 2 * 2 and all(t.abs().max() > 0 for t in experts_b)  # B starts at zero: it trained
    names = list(Qwen3MoE(cfg).state_dict())  # the base the runs drew from the seed, as train.py draws it
    H.save_hf(str(tmp_path / "base"), cfg, H.load_or_init_state_dict(None, cfg, names, torch.float32, 0, "cpu"))
    ids = torch.randint(0, 257, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        base = hf(ids).logits
        want = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))(ids).logits
        assert (want - base).abs().max() > 1e-3  # the adapters trained away from zero
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_lora_on_the_experts_killed_and_resumed_continues_exactly(tmp_path):
    """--lora_targets q_proj,experts on a Qwen3-MoE at cp 2, killed mid-step and relaunched: it gives the
    uninterrupted run's losses and grad norms bit for bit (the experts' adapters and their AdamW states are in the
    checkpoint, sharded like the rest), and the merged export loads in transformers."""
    import transformers
    from .test_lora import killed_and_resumed
    folder = tmp_path / "moe"
    folder.mkdir()
    cfg = moe_cfg(vocab_size=257, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, mlp_only_layers=[])
    (folder / "config.json").write_text(json.dumps(H.config_to_dict(cfg)))
    killed_and_resumed(tmp_path, ["--model", str(folder)],
                       lora=("--lora_rank", "4", "--lora_targets", "q_proj,experts", "--lr", "1e-2"))
    assert type(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))).__name__ == \
        "Qwen3MoeForCausalLM"
