"""--fit auto in train.py (run on CPU with capacities given): the plan it prints and trains with, a lever given on the
command line, stochastic rounding or LoRA where fp32 state cannot fit, a node where nothing fits; and
bench/plan_check.py, which puts the plan's prediction beside the run. plan.py itself: tests/test_plan.py."""
import json
import os
import subprocess
import sys

from million import hf
from million import plan
from model import Qwen3Config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_train(tmp_path, *args):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", "tiny", "--tokenizer", "byte", "--data",
           "synthetic", "--device", "cpu", "--dtype", "float32", "--yarn_factor", "0", "--seq_len", "2048",
           "--max_steps", "1", "--loss_chunk", "512", "--checkpoints", "false", "--out_dir", str(tmp_path / "run"),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_fit_auto_in_train_py(tmp_path):
    """With capacities given (on CPU too), train.py prints the plan and trains with it; a lever on the command line
    wins; a node where nothing fits stops with one line naming the nearest plan."""
    s = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, act_bytes=4, loss_chunk=512)  # as run_train runs
    gpu = plan.predict(s, plan.Levers(1, 2)).gpu_gib / plan.GPU_MARGIN * 1.0001  # fits with 1 of 2 blocks offloaded
    lv, _ = plan.choose(s, gpu, 100)
    assert lv.offload_layers >= 1
    p = run_train(tmp_path, "--gpu_mem_gib", f"{gpu:.6f}", "--host_mem_gib", "100")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fit: " in p.stdout and (f"offload_layers {lv.offload_layers}/2, keep_attention_layers "
                                    f"{lv.keep_attention_layers}/2") in p.stdout, p.stdout
    cfg = json.load(open(tmp_path / "run" / "train_config.json"))
    assert cfg["offload"] and cfg["offload_layers"] == lv.offload_layers
    assert cfg["keep_attention_layers"] == lv.keep_attention_layers
    p = run_train(tmp_path, "--gpu_mem_gib", f"{gpu:.6f}", "--host_mem_gib", "100", "--keep_attention", "false",
                  "--resume", "none", "--overwrite", "true")
    assert p.returncode == 0 and "keep_attention_layers 0/2" in p.stdout and "given: keep_attention_layers" in p.stdout
    p = run_train(tmp_path, "--gpu_mem_gib", "0.0001", "--host_mem_gib", "100")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode != 0 and len(lines) == 1 and "no set of levers fits" in lines[0], p.stderr[-2000:]


def test_fit_auto_turns_to_stochastic_rounding_where_fp32_state_cannot_fit(tmp_path):
    """A GPU too small for fp32 weights and AdamW states with any levers, big enough for bf16 ones: --fit auto runs
    bf16 state with stochastic rounding and says so; with --param_dtype given, it stops with the plan's line."""
    fp32 = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, act_bytes=4, loss_chunk=512)
    bf16 = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, param_bytes=2, act_bytes=4, loss_chunk=512)
    least = {s.param_bytes: min(plan.gpu_bytes(s, plan.Levers(off, keep)) for off in range(3) for keep in range(3))
             for s in (fp32, bf16)}
    gpu = (least[2] + least[4]) / 2 / plan.GPU_MARGIN / 2**30  # between the two
    p = run_train(tmp_path, "--gpu_mem_gib", f"{gpu:.6f}", "--host_mem_gib", "100")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "bf16 ones with stochastic rounding do" in p.stdout, p.stdout
    cfg = json.load(open(tmp_path / "run" / "train_config.json"))
    assert cfg["param_dtype"] == "bfloat16" and cfg["stochastic_rounding"]
    p = run_train(tmp_path, "--gpu_mem_gib", f"{gpu:.6f}", "--host_mem_gib", "100", "--param_dtype", "float32",
                  "--resume", "none", "--overwrite", "true")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode != 0 and len(lines) == 1 and "--stochastic_rounding true" in lines[0], p.stderr[-2000:]


def test_plan_check_puts_the_prediction_beside_the_run(tmp_path):
    """bench/plan_check.py reads train.py's plan line and metrics: the levers and predictions it records are the
    planner's, the measurements the run's; a second run of the same configuration replaces the first."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf.config_to_dict(Qwen3Config.tiny())))
    gpu = 1.0
    cmd = [sys.executable, os.path.join(ROOT, "bench", "plan_check.py"), "--nproc", "1", "--model", str(folder),
           "--seq_len", "2048", "--steps", "2", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "pc.json"),
           "--extra", f"--device cpu --dtype float32 --yarn_factor 0 --loss_chunk 512 --gpu_mem_gib {gpu} "
                      "--host_mem_gib 100"]
    for _ in range(2):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (r,) = json.load(open(tmp_path / "pc.json"))
    s = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, act_bytes=4, loss_chunk=512)
    lv, cost = plan.choose(s, gpu, 100)
    assert (r["offload_layers"], r["keep_attention_layers"]) == (lv.offload_layers, lv.keep_attention_layers)
    assert r["predicted_gpu_gib"] == round(cost.gpu_gib, 1) and r["predicted_host_gib"] == round(cost.host_gib, 1)
    assert r["steps"] == 2 and len(r["losses"]) == 2 and r["backend"] == "cpu" and r["param_dtype"] == "float32"
    assert r["s_per_step"] > 0 and r["peak_mem_gib"] > 0 and r["time_to_first_step_s"] > 0


def test_fit_auto_in_train_py_with_lora(tmp_path):
    """A GPU too small for the tiny model's full fine-tune (fp32 state, or bf16 with stochastic rounding) with any
    levers, big enough for LoRA's: --fit auto plans and trains the LoRA run."""
    full = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, act_bytes=4, loss_chunk=512)
    sr = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, param_bytes=2, act_bytes=4, loss_chunk=512,
                       stochastic_rounding=True)
    lo = plan.Shape.of(Qwen3Config.tiny(), 2048, 1, 1, 1, act_bytes=4, loss_chunk=512, lora_rank=4,
                       lora_targets=("q_proj", "v_proj"))
    least = [min(plan.gpu_bytes(s, plan.Levers(off, keep)) for off in range(3) for keep in range(3))
             for s in (full, sr, lo)]
    assert least[2] < min(least[:2])
    gpu = (least[2] + min(least[:2])) / 2 / plan.GPU_MARGIN / 2**30
    p = run_train(tmp_path, "--gpu_mem_gib", f"{gpu:.6f}", "--host_mem_gib", "100", "--lora_rank", "4",
                  "--lora_targets", "q_proj,v_proj")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fit: " in p.stdout and "LoRA: rank 4" in p.stdout, p.stdout
    assert json.load(open(tmp_path / "run" / "train_config.json"))["param_dtype"] == "float32"
