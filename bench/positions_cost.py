"""What loss by position and held-out evaluation cost (train.py --loss_buckets, --eval_every, --eval_only), on one
GPU with a random-init Qwen3-1.7B at 131,072 tokens.

    python bench/positions_cost.py                                       # H200, ~5 minutes
    python bench/positions_cost.py --model tiny --device cpu --seq_len 512   # the script's logic only, ~1 minute

1. The buckets' added work, timed alone at the step's shapes (CUDA events around synchronised loops): writing each
   chunk's per-row NLL into row_nll (one index_copy per chunk of --loss_chunk rows) and PositionSums.add (two
   index_adds over the rank's rows). The all-reduce is the one the loss already needed, 2k + 1 numbers instead of
   1. For scale, the chunked loss itself (forward + backward) at the same shape.
2. A training run (train.py, 3 steps, --eval_every 3: evaluations before step 1 and after step 3): step time and
   peak memory, and the evaluation's time and peak memory (the one after step 3: warm).
3. An --eval_only run (no optimizer, nothing kept for a backward): its time and peak memory.
Prints a table; writes bench/results/positions_cost.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

from timing import median_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bucket_work(T, H, V, chunk, k, device, dtype, reps):
    """Seconds of (row_nll writes, PositionSums.add, the chunked loss fwd+bwd) for T rows on one rank."""
    from loss import chunked_nll
    from data import Micro
    from million.evaluate import PositionSums
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(T, H, device=device, generator=g).to(dtype).requires_grad_()             # [T, H]
    weight = (torch.randn(V, H, device=device, generator=g) / H**0.5).to(dtype).requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (T,), device=device, generator=g)                               # [T]
    rows = torch.arange(T, device=device)
    per_chunk = torch.rand(T, device=device, generator=g)                                        # [T] fp32

    def row_writes():  # what chunked_nll adds per chunk for row_nll, and the sum that replaced a running total
        row_nll = torch.zeros(T, dtype=torch.float32, device=device)
        for s in range(0, T, chunk):
            row_nll.index_copy_(0, rows[s:s + chunk], per_chunk[s:s + chunk])
        return row_nll.sum()

    out = chunked_nll(hidden, weight, labels, chunk_size=chunk)
    positions = rows[None]                                                                       # [1, T]

    micro = Micro(inputs=labels[None], labels=labels[None], positions=positions)

    def add():
        PositionSums(T, k, device).add(out, micro)

    def loss_step():
        s, _ = chunked_nll(hidden, weight, labels, chunk_size=chunk)
        s.backward()
        hidden.grad = weight.grad = None

    return (median_seconds(row_writes, device, reps), median_seconds(add, device, reps),
            median_seconds(loss_step, device, max(reps // 5, 2)))


def train_py(args, out, *flags):
    """train.py on one rank (torchrun, as a user runs it); -> (metrics rows, eval rows)."""
    model = args.model if args.model == "tiny" else os.path.join(ROOT, "bench", "configs", args.model)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "train.py"), "--model", model, "--tokenizer", "byte", "--data", "synthetic",
           "--seq_len", str(args.seq_len), "--cp", "1", "--device", args.device, "--checkpoints", "false",
           "--loss_buckets", str(args.buckets), "--eval_sequences", str(args.eval_sequences), "--out_dir", out,
           "--resume", "none", "--overwrite", "true", *flags, *args.extra.split()]
    if args.device == "cpu":
        cmd += ["--dtype", "float32", "--offload", "false", "--loss_chunk", "128"]
    print("$ " + " ".join(cmd[4:]), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    print("\n".join("    " + line for line in p.stdout.splitlines() if line.startswith(("step", "eval", "fit"))))
    if p.returncode != 0:
        raise SystemExit(f"train.py failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")

    def rows(name):
        path = os.path.join(out, name)
        return [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return rows("metrics.jsonl"), rows("eval.jsonl")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-1.7b", help="a folder name under bench/configs, or tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq_len", type=int, default=131072)
    ap.add_argument("--buckets", type=int, default=16)
    ap.add_argument("--eval_sequences", type=int, default=2)
    ap.add_argument("--loss_chunk", type=int, default=2048, help="train.py's default; for part 1")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--extra", default="", help="more train.py flags for both runs")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--work", default="/tmp/positions_cost")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "positions_cost.json"))
    args = ap.parse_args()
    from million import hf
    from model import Qwen3Config
    mcfg = Qwen3Config.tiny() if args.model == "tiny" else hf.read_config(
        os.path.join(ROOT, "bench", "configs", args.model))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    chunk = args.loss_chunk if args.device == "cuda" else 128

    print(f"1. bucket work alone: {args.seq_len:,} rows, hidden {mcfg.hidden_size}, vocab {mcfg.vocab_size}, "
          f"chunk {chunk}, {args.buckets} buckets", flush=True)
    t_rows, t_add, t_loss = bucket_work(args.seq_len, mcfg.hidden_size, mcfg.vocab_size, chunk, args.buckets,
                                        device, dtype, args.reps)
    print(f"    row_nll writes {t_rows * 1e3:.3f} ms, PositionSums.add {t_add * 1e3:.3f} ms, "
          f"chunked loss fwd+bwd {t_loss * 1e3:.1f} ms", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # train.py runs in its own process next: leave it the memory

    print("2. training, 3 steps, evaluations before and after", flush=True)
    steps, evals = train_py(args, os.path.join(args.work, "train"), "--max_steps", "3", "--eval_every", "3")
    step_s = statistics.median(r["step_time_s"] for r in steps[1:] or steps)
    print("3. evaluation only", flush=True)
    _, only = train_py(args, os.path.join(args.work, "eval_only"), "--eval_only", "true")

    warm, lone = evals[-1], only[-1]
    res = dict(model=args.model, device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               seq_len=args.seq_len, buckets=args.buckets, loss_chunk=chunk, torch=torch.__version__,
               row_nll_writes_ms=t_rows * 1e3, position_sums_add_ms=t_add * 1e3, chunked_loss_ms=t_loss * 1e3,
               step_s=step_s, bucket_share_of_step=(t_rows + t_add) / step_s,
               train_peak_mem_gib=max(r["peak_mem_gib"] for r in steps),
               eval_s_per_sequence=warm["eval_time_s"] / warm["sequences"],
               eval_peak_mem_gib=warm["peak_mem_gib"], eval_only_s_per_sequence=lone["eval_time_s"] / lone["sequences"],
               eval_only_peak_mem_gib=lone["peak_mem_gib"], eval_loss=warm["loss"],
               command="python bench/positions_cost.py " + " ".join(sys.argv[1:]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=2)
    gib = (lambda x: "-" if x is None else f"{x:.1f} GiB")  # noqa: E731 (None on CPU)
    print(f"\n{args.model}, {args.seq_len:,} tokens, one {res['device']}:")
    print(f"  buckets: {(t_rows + t_add) * 1e3:.2f} ms a step ({t_rows * 1e3:.2f} row_nll writes + "
          f"{t_add * 1e3:.2f} sums) = {res['bucket_share_of_step']:.4%} of a {step_s:.2f} s step "
          f"(target < 1%); the chunked loss alone {t_loss * 1e3:.0f} ms")
    print(f"  training step: {step_s:.2f} s, peak {gib(res['train_peak_mem_gib'])}")
    print(f"  evaluation during training: {res['eval_s_per_sequence']:.2f} s per sequence, peak "
          f"{gib(res['eval_peak_mem_gib'])}")
    print(f"  --eval_only: {res['eval_only_s_per_sequence']:.2f} s per sequence (with the first call's warm-up), "
          f"peak {gib(res['eval_only_peak_mem_gib'])}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
