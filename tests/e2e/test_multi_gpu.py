"""train.py over NCCL on two GPUs (skipped with fewer): data parallelism and gradient accumulation, with and
without context parallelism, are the same optimisation as one GPU accumulating the same sequences.

    pytest -m gpu tests/e2e/test_multi_gpu.py -s      # -s prints the per-step table

The CPU versions (gloo, fp32) are in test_train.py and hold to 1e-5; here the compute is bf16 (weights and AdamW
states fp32), so the bounds are bf16's: the sums of a step's gradients run in another order on two ranks."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 16384


def train(tmp_path, nproc, *args):
    out = tmp_path / f"n{nproc}_{'_'.join(args).replace('-', '')}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train.py"), "--model", os.path.join(ROOT, "bench", "configs", "qwen3-1.7b"),
           "--tokenizer", "byte", "--data", "synthetic", "--seq_len", str(SEQ), "--max_steps", "4",
           "--warmup_steps", "1", "--lr", "1e-4", "--checkpoints", "false", "--out_dir", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_data_parallel_over_nccl_equals_gradient_accumulation(tmp_path):
    one = train(tmp_path, 1, "--cp", "1", "--grad_accum", "2")
    dp2 = train(tmp_path, 2, "--cp", "1")                          # dp 2 x cp 1: one sequence per rank
    cp2 = train(tmp_path, 2, "--cp", "2", "--grad_accum", "2")     # dp 1 x cp 2, accumulating two sequences
    print(f"\n{'step':>4} {'1 GPU, grad_accum 2':>24} {'dp 2':>24} {'cp 2, grad_accum 2':>24}   (loss / grad norm)")
    for a, b, c in zip(one, dp2, cp2):
        print(f"{a['step']:>4} " + " ".join(f"{r['loss']:>12.6f} {r['grad_norm']:>11.5f}" for r in (a, b, c)))
    for other in (dp2, cp2):
        assert len(other) == len(one) == 4
        for a, b in zip(one, other):
            assert a["num_tokens"] == b["num_tokens"] == 2 * SEQ
            assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]  # the steps did train


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_qwen3_5_at_cp_2_over_nccl_equals_one_gpu(tmp_path):
    """A small Qwen3.5 (3 DeltaNet layers, 1 gated attention layer, random init) on the DeltaNet kernels
    --deltanet_kernel auto picks (fla where it runs): cp 2 over NCCL, where each rank's first chunk runs with the
    span summaries' extra value columns and the summaries cross the ranks, gives one GPU's losses and grad norms
    within bf16's bounds."""
    from transformers import Qwen3_5TextConfig
    folder = tmp_path / "qwen3_5"
    Qwen3_5TextConfig(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                      max_position_embeddings=32768).save_pretrained(folder)
    one = train(tmp_path, 1, "--model", str(folder), "--cp", "1")
    cp2 = train(tmp_path, 2, "--model", str(folder), "--cp", "2")
    for a, b in zip(one, cp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]
