"""Two faults that used to hold the GPUs, done to a real run over NCCL: a frozen peer, and the reader of the
output going away.

    python bench/dead_peer.py --nproc 2 --model qwen3-1.7b --seq_len 32768 --out bench/results/dead_peer_x2.json

1. frozen peer: after step 5 (a checkpoint at step 4), rank 1 gets SIGSTOP (a hung process, which torchrun does not notice: it only reacts
   to a worker that exits). Recorded: the seconds until rank 0 exits, until torchrun exits, the checkpoint kept,
   and what nvidia-smi still shows afterwards.
2. dead pipe: the run's stdout is a pipe whose reader closes it after step 4 (as a killed `tee` or a killed
   Python parent with capture_output). Recorded: whether the run trained to its last step, and train.log's rows.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_survival import alive, children, rank_of  # noqa: E402


def command(a, out, steps, *flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
            os.path.join(ROOT, "train.py"), "--model", os.path.join(ROOT, "bench", "configs", a.model),
            "--tokenizer", "byte", "--data", "synthetic", "--seq_len", str(a.seq_len), "--max_steps", str(steps),
            "--out_dir", out, "--resume", "none", "--overwrite", "true", *flags]


def rows(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(x) for x in open(path)] if os.path.exists(path) else []


def wait_rows(out, n, proc, limit=600):
    t0 = time.time()
    while len(rows(out)) < n:
        if proc.poll() is not None or time.time() - t0 > limit:
            raise SystemExit(f"error: the run ended or stalled before step {n}")
        time.sleep(0.2)


def gpu_processes():
    p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return [x.strip() for x in p.stdout.splitlines() if x.strip()]


def frozen_peer(a):
    out = os.path.join(a.work, "frozen")
    proc = subprocess.Popen(command(a, out, 1000, "--ckpt_every", "4"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_rows(out, 6, proc)
    workers = {rank_of(pid): pid for pid in children(proc.pid)}
    os.kill(workers[1], signal.SIGSTOP)
    t0, rank0_s = time.time(), None
    while proc.poll() is None and time.time() - t0 < 300:
        if rank0_s is None and not alive(workers[0]):
            rank0_s = time.time() - t0
        time.sleep(0.2)
    torchrun_s = time.time() - t0
    said = proc.stdout.read()
    left = [pid for pid in workers.values() if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    saved = sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_") and "." not in d)
    return dict(stopped_after_step=len(rows(out)), rank0_exit_s=rank0_s, torchrun_exit_s=torchrun_s,
                workers_left=len(left), newest_checkpoint=saved[-1] if saved else None, gpu_processes_after=gpu_processes(),
                lines=[x for x in said.splitlines() if x.startswith("error")][:4])


def dead_pipe(a):
    out, steps = os.path.join(a.work, "pipe"), 10
    proc = subprocess.Popen(command(a, out, steps, "--checkpoints", "false"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_rows(out, 4, proc)
    proc.stdout.close()
    t0 = time.time()
    code = proc.wait(timeout=600)
    log = open(os.path.join(out, "train.log")).read()
    return dict(exit_code=code, steps=[r["step"] for r in rows(out)], seconds_after_close=time.time() - t0,
                train_log_has_last_step=f"step {steps:4d}/{steps} [" in log, gpu_processes_after=gpu_processes())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--seq_len", type=int, default=32768)
    ap.add_argument("--work", default="/tmp/dead_peer")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dead_peer_x2.json"))
    a = ap.parse_args()
    res = dict(model=a.model, seq_len=a.seq_len, nproc=a.nproc, frozen_peer=frozen_peer(a), dead_pipe=dead_pipe(a))
    print(json.dumps(res, indent=1))
    json.dump(res, open(a.out, "w"), indent=1)
