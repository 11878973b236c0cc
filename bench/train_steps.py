"""Time real training steps of train.py on one GPU: random-init Qwen3 shapes, synthetic data, a few steps each.

    python bench/train_steps.py                                   # the table in bench/RESULTS.md
    python bench/train_steps.py --runs qwen3-1.7b:32768 --steps 3 --extra "--offload false"

Weights and AdamW states are bf16 (--param_dtype bfloat16), as in the reference recipe's single-GPU run that the
bench/RESULTS.md compares with; --extra "--param_dtype float32" gives train.py's default (fp32 master weights: 8 more bytes
per parameter, 30 GiB more for Qwen3-4B on one GPU, 1/world of that under FSDP2).
Each run is `torchrun --nproc_per_node 1 train.py ...` in its own process (so peak memory is per run); the step
time is the median of the steps after the first (which includes compilation and warm-up). MFU counts useful
FLOPs only (6 per parameter per token + causal attention, no recompute) against 989 TFLOP/s dense bf16.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(model, seq_len, steps, extra, out_root, timeout):
    out = os.path.join(out_root, f"{model}_{seq_len}_{abs(hash(extra)) % 10**6}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "train.py"),
           "--model", model if model == "tiny" else os.path.join(ROOT, "bench", "configs", model),
           "--tokenizer", "byte", "--data", "synthetic", "--seq_len", str(seq_len), "--max_steps", str(steps),
           "--cp", "1", "--param_dtype", "bfloat16", "--checkpoints", "false", "--fit", "off", "--out_dir", out, *extra.split()]
    print("$", " ".join(cmd[4:]), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:])
        # train.py's own message ("error: ..."), not torchrun's summary that follows it
        said = [line for line in p.stderr.splitlines() if line.startswith("error")]
        return dict(model=model, seq_len=seq_len, extra=extra, error=" | ".join(said) or p.stderr[-500:])
    for line in p.stdout.splitlines():
        if line.startswith(("step", "offload", "time to first")):
            print("   ", line)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    timed = rows[1:] or rows
    t = statistics.median(r["step_time_s"] for r in timed)
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]  # None on CPU
    return dict(model=model, seq_len=seq_len, extra=extra, out_dir=out, s_per_step=t, tokens_per_s=seq_len / t,
                mfu=statistics.median(mfu) if mfu else 0.0,
                peak_mem_gib=max(r["peak_mem_gib"] for r in rows), host_offload_gib=rows[-1]["host_pinned_gib"],
                loss=rows[-1]["loss"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="qwen3-1.7b:32768,qwen3-1.7b:65536,qwen3-1.7b:131072,qwen3-4b:32768,"
                                      "qwen3-4b:65536,qwen3-4b:131072")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--extra", default="", help="more train.py flags for every run")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "train_steps.json"))
    a = ap.parse_args()
    results = []
    for spec in a.runs.split(","):
        model, seq = spec.split(":")
        results.append(run_one(model, int(seq), a.steps, a.extra, "/tmp/bench_runs", a.timeout))
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=2)
    print(f"\n{'model':<12}{'tokens':>9}{'s/step':>9}{'tok/s':>9}{'MFU':>7}{'peak GiB':>10}{'host GiB':>10}  flags")
    for r in results:
        if "error" in r:
            print(f"{r['model']:<12}{r['seq_len']:>9}  failed: {r['error'][-200:]!r}")
            continue
        print(f"{r['model']:<12}{r['seq_len']:>9}{r['s_per_step']:>9.2f}{r['tokens_per_s']:>9,.0f}{r['mfu']:>7.1%}"
              f"{r['peak_mem_gib']:>10.1f}{r['host_offload_gib']:>10.1f}  {r['extra']}")


if __name__ == "__main__":
    main()
