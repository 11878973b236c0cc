"""train.py with QLoRA (--lora_rank 4 --quantize nf4) on 2 ranks, Qwen3 and Qwen3.5-MoE, killed and resumed: it
continues exactly, and its exports load in PEFT and transformers. lora.py against PEFT in-process and in gloo worlds: tests/test_lora.py.

    python -m pytest tests/e2e/test_lora.py -q
"""
import torch

from million import lora
from million.hf import load_or_init_state_dict, save_hf
from model import Qwen3, Qwen3Config


QLORA = ("--lora_rank", "4", "--quantize", "nf4")


def killed_and_resumed(tmp_path, args, ref_args=(), lora=QLORA):
    """train.py with `lora` (QLoRA by default) and args for 4 steps on 2 ranks, a checkpoint every 2: uninterrupted
    in tmp_path/ref (with ref_args), and in tmp_path/run killed in step 3, then relaunched to export the merged
    model to tmp_path/merged. The relaunch resumes after step 2 and gives the uninterrupted run's steps exactly."""
    from .test_long_runs import assert_same_run, launch, rows, steps
    args = ["--max_steps", "4", "--ckpt_every", "2", *lora, *args]
    p = launch(2, tmp_path / "ref", *args, *ref_args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the base frozen in NF4" in p.stdout or "--quantize" not in lora
    assert launch(2, tmp_path / "run", *args, fault="kill:1:3").returncode != 0
    assert steps(tmp_path / "run") == [2]
    p = launch(2, tmp_path / "run", *args, "--save_dir", str(tmp_path / "merged"), "--merge_lora", "true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "after step 2" in p.stdout
    assert_same_run(rows(tmp_path / "run"), rows(tmp_path / "ref"))


def assert_merged_is_peft_over(tmp_path, cfg, sd):
    """The uninterrupted run's PEFT folder (tmp_path/adapter) over the base sd (as NF4 gives it back) and the resumed
    run's merged export (tmp_path/merged) give the same logits."""
    import peft
    import transformers
    save_hf(str(tmp_path / "base"), cfg, sd)
    ids = torch.randint(0, 257, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        want = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_qlora_run_killed_and_resumed_continues_exactly(tmp_path):
    """train.py --lora_rank 4 --quantize nf4 on 2 ranks (cp 2, the tiled MLP, kept attention, the last block keeping
    its MLP outputs): killed mid-step and relaunched, it gives the uninterrupted run's losses and grad norms bit
    for bit; its checkpoints hold the adapters and their AdamW states only. The uninterrupted run's PEFT folder
    over the dequantized base and the resumed run's merged export give the same logits (the same adapters,
    exported both ways)."""
    killed_and_resumed(tmp_path, ["--tiled_mlp", "true", "--mlp_tile", "50", "--keep_mlp_layers", "1"],
                       ["--save_dir", str(tmp_path / "adapter")])
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step_0000004")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2 and all(lora.is_adapter(k) for k in model_keys)
    assert all(lora.is_adapter(k) for k in keys if k.startswith("optim.state."))
    # the base the runs drew (--model tiny, seed 0), as NF4 gives it back
    cfg = Qwen3Config.tiny()
    names = list(Qwen3(cfg).state_dict())
    sd = load_or_init_state_dict(None, cfg, names, torch.float32, 0, "cpu")
    sd = {n: lora.nf4(t).get_original_weight() if n.endswith("proj.weight") else t for n, t in sd.items()}
    assert_merged_is_peft_over(tmp_path, cfg, sd)


def test_qlora_on_qwen3_5_moe_killed_and_resumed_exports_what_peft_computes(tmp_path):
    """QLoRA on a tiny Qwen3.5-MoE (the routed experts' stacked weights in NF4 too, and adapted), on 2 ranks at cp 2
    with the experts tiled: killed mid-step and relaunched, it gives the uninterrupted run's steps bit for bit. The
    uninterrupted run's PEFT folder over the base as NF4 gives it back (PEFT's target_parameters on the experts)
    and the resumed run's merged export give the same logits."""
    import transformers
    from million import qwen3_5
    model = tmp_path / "qwen3_5_moe"
    transformers.Qwen3_5MoeTextConfig(  # every projection and stacked expert weight a multiple of NF4's 1,024 values
        vocab_size=257, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=16, linear_key_head_dim=16,
        linear_value_head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=4096,
        initializer_range=0.05).save_pretrained(model)
    targets = ",".join(lora.TARGETS + (lora.EXPERTS,))
    killed_and_resumed(tmp_path, ["--model", str(model), "--lora_targets", targets, "--mlp_tile", "50"],
                       ["--save_dir", str(tmp_path / "adapter")])
    # the base the runs drew (seed 0), as NF4 gives it back
    cfg = qwen3_5.read_config(str(model))
    m = lora.apply(qwen3_5.Qwen3_5Moe(cfg), 4, targets=targets, quantize="nf4")
    quantized = {f"{name}.{n}" for name, x in m.named_modules() if isinstance(x, (lora.LoRALinear, lora.LoRAExperts))
                 for n in x._buffers}
    assert sum(".mlp.experts." in n for n in quantized) == 4 * 3
    names = [n for n in m.state_dict() if not lora.is_adapter(n)]
    sd = load_or_init_state_dict(str(model), cfg, names, torch.float32, 0, "cpu")
    sd = {n: lora.nf4(t.reshape(-1, t.shape[-1])).get_original_weight().view(t.shape) if n in quantized else t
          for n, t in sd.items()}
    assert_merged_is_peft_over(tmp_path, cfg, sd)
