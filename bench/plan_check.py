"""The cost model (plan.py) against real runs: train.py under `--fit auto` prints its plan and predictions before
step 1; this runs it and puts the predictions beside what the run measured.

    python bench/plan_check.py --nproc 2 --model qwen3-8b --seq_len 524288 --steps 1
    python bench/plan_check.py --nproc 1 --model qwen3-4b --seq_len 131072 --extra "--param_dtype bfloat16"
    python bench/fit_plan.py --check   # the errors of every run recorded here, with the constants of the day

Random-init shapes from bench/configs, synthetic tokens, no checkpoints; every rank of one sequence (cp = nproc)
unless --extra says --cp. Each run is appended to --out (a run with the same model, length, world, dtype,
backend and levers replaces the older one). The step time is the median of the steps after the first; with one
step, that step (which then includes the kernels' compilation: a few seconds, see first_step_s elsewhere).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIT = re.compile(r"offload_layers (\d+)/\d+, keep_attention_layers (\d+)/\d+.*predicted ([\d.]+) s/step, ([\d.]+) "
                 r"GiB GPU per rank, ([\d.]+) GiB pinned host per rank")


def run(a):
    out = os.path.join(a.work, f"{os.path.basename(a.model)}_{a.seq_len}_{a.nproc}_{abs(hash(a.extra)) % 10**6}")
    flags = a.extra.split()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           os.path.join(ROOT, "train.py"), "--model", os.path.join(ROOT, "bench", "configs", a.model),
           "--tokenizer", "byte", "--data", "synthetic", "--seq_len", str(a.seq_len), "--max_steps", str(a.steps),
           "--checkpoints", "false", "--resume", "none", "--overwrite", "true", "--out_dir", out,
           *([] if "--cp" in flags else ["--cp", str(a.nproc)]), *flags]
    print("$", " ".join(cmd[3:]), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    said = p.stdout + p.stderr
    for line in said.splitlines():
        if line.startswith(("fit:", "offload:", "model:", "step", "time to first", "error", "warning")):
            print("   ", line[:400], flush=True)
    if p.returncode != 0:
        print(p.stderr[-3000:])
        raise SystemExit(f"error: the run failed (exit {p.returncode}) after {time.time() - t0:.0f} s")
    fit = FIT.search(said)
    if not fit:
        raise SystemExit("error: no plan in the output: plan_check needs --fit auto (train.py's default)")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    cfg = json.load(open(os.path.join(out, "train_config.json")))
    timed = rows[1:] or rows
    return dict(model=a.model, seq_len=a.seq_len, cp=cfg["cp"] or a.nproc, world=a.nproc, extra=a.extra,
                param_dtype=cfg["param_dtype"], backend=re.search(r"attention kernels: (\w+)", said).group(1),
                offload_layers=int(fit[1]), keep_attention_layers=int(fit[2]),
                predicted_s=float(fit[3]), predicted_gpu_gib=float(fit[4]), predicted_host_gib=float(fit[5]),
                s_per_step=statistics.median(r["step_time_s"] for r in timed), first_step_s=rows[0]["step_time_s"],
                steps=len(rows), peak_mem_gib=max(r["peak_mem_gib"] for r in rows),
                host_pinned_gib=rows[-1]["host_pinned_gib"], mfu=rows[-1]["mfu"], losses=[r["loss"] for r in rows],
                time_to_first_step_s=float(re.search(r"time to first step: ([\d.]+)", said).group(1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7b", help="a folder name under bench/configs")
    ap.add_argument("--seq_len", type=int, default=131072)
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) on this node")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--extra", default="", help="more train.py flags")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--work", default="/tmp/plan_check", help="where the runs' folders go")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_check.json"))
    a = ap.parse_args()
    r = run(a)
    print(f"predicted {r['predicted_s']:.1f} s/step, {r['predicted_gpu_gib']:.1f} GiB; measured {r['s_per_step']:.1f} "
          f"s/step ({r['predicted_s'] / r['s_per_step'] - 1:+.1%}), {r['peak_mem_gib']:.1f} GiB "
          f"({r['predicted_gpu_gib'] / r['peak_mem_gib'] - 1:+.1%}); pinned host {r['host_pinned_gib']:.1f} GiB "
          f"(predicted {r['predicted_host_gib']:.1f})", flush=True)
    key = ("model", "seq_len", "world", "cp", "param_dtype", "backend", "offload_layers", "keep_attention_layers")
    runs = json.load(open(a.out)) if os.path.exists(a.out) else []
    runs = [x for x in runs if any(x.get(k) != r[k] for k in key)] + [r]
    with open(a.out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
