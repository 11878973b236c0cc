"""Loss curves of bf16 weights with stochastic rounding beside fp32 master weights, on CPU: the demo's tiny Qwen3,
512 tokens per step, lr 1e-4 (small enough that round-to-nearest bf16 weights lose most updates), bf16 compute.

    python bench/sr_curve.py --steps 300    # ~2 minutes on 2 cores -> bench/results/sr_curve.json

Runs fp32 (seed 0), fp32 (seed 1: the run-to-run noise), bf16 + stochastic rounding (seed 0) and plain bf16
(seed 0), two at a time, and prints the mean loss of each 50 steps.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"fp32": ["--param_dtype", "float32"], "fp32_seed1": ["--param_dtype", "float32", "--seed", "1"],
        "stochastic": ["--param_dtype", "bfloat16", "--stochastic_rounding", "true"],
        "bf16": ["--param_dtype", "bfloat16"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--work", default="/tmp/sr_curve")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "sr_curve.json"))
    a = ap.parse_args()
    names, curves = list(RUNS), {}
    for pair in (names[:2], names[2:]):
        procs = {}
        for n in pair:
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", "demo", "--seq_len", "512",
                   "--max_steps", str(a.steps), "--lr", "1e-4", "--warmup_steps", "10", "--dtype", "bfloat16",
                   "--checkpoints", "false", "--resume", "none", "--overwrite", "true",
                   "--out_dir", os.path.join(a.work, n), *RUNS[n]]
            procs[n] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for n, p in procs.items():
            if p.wait() != 0:
                sys.exit(f"error: the {n} run failed")
            curves[n] = [json.loads(line)["loss"] for line in open(os.path.join(a.work, n, "metrics.jsonl"))]
    means = {n: [round(statistics.mean(c[i:i + 50]), 4) for i in range(0, len(c), 50)] for n, c in curves.items()}
    for n, m in means.items():
        print(f"{n:12s} " + " ".join(f"{x:.3f}" for x in m))
    json.dump(dict(command=f"python bench/sr_curve.py --steps {a.steps}", steps=a.steps, lr=1e-4, seq_len=512,
                   mean_loss_per_50_steps=means, losses=curves), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
