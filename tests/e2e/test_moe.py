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
