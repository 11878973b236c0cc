"""train.py with QLoRA (--lora_rank 4 --quantize nf4) on 2 ranks, killed and resumed: it continues exactly, and its
exports load in PEFT and transformers. lora.py against PEFT in-process and in gloo worlds: tests/test_lora.py.

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


def test_qlora_run_killed_and_resumed_continues_exactly(tmp_path):
    """train.py --lora_rank 4 --quantize nf4 on 2 ranks (cp 2, the tiled MLP, kept attention, the last block keeping
    its MLP outputs): killed mid-step and relaunched, it gives the uninterrupted run's losses and grad norms bit
    for bit; its checkpoints hold the adapters and their AdamW states only. The uninterrupted run's PEFT folder
    over the dequantized base and the resumed run's merged export give the same logits (the same adapters,
    exported both ways)."""
    import peft
    import transformers
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
    save_hf(str(tmp_path / "base"), cfg, sd)
    ids = torch.randint(0, 257, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        want = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
