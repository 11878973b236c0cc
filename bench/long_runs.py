"""Checkpoints of a real-size run: save and load time and size under FSDP2, a SIGTERM mid-run and the resume.

    python bench/long_runs.py                                   # Qwen3-8B, 2 GPUs (cp 2), 8,192 tokens a step
    python bench/long_runs.py --model tiny --nproc 2 --device cpu --seq_len 264 --root /tmp/lr   # a dry run on CPU

Two launches of the same train.py command, as a scheduler would make them:
  1. --max_steps 5 --ckpt_every 2: a checkpoint after step 2; after step 3 the workers get SIGTERM (as from Slurm's
     --signal), finish the step, save a checkpoint and exit with 75. Time from the signal to the exit is measured.
  2. the same command again: it resumes from step 3 (the load is timed) and runs steps 4-5 (a checkpoint at 5).
Weights and AdamW states in bf16 (--param_dtype bfloat16): 6 bytes per parameter, 49 GB for Qwen3-8B, so that two
checkpoints fit the GPU machine's disk (--keep_checkpoints 1 keeps at most the new one and the one before).
Prints a table and writes bench/results/long_runs.json.
"""
import argparse
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq_len", type=int, default=8192)
    ap.add_argument("--root", default="/tmp/long_runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "long_runs.json"))
    a = ap.parse_args()
    shutil.rmtree(a.root, ignore_errors=True)
    out = os.path.join(a.root, "run")
    model = a.model if a.model == "tiny" else os.path.join(ROOT, "bench", "configs", a.model)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           os.path.join(ROOT, "train.py"), "--model", model, "--tokenizer", "byte", "--data", "synthetic",
           "--seq_len", str(a.seq_len), "--cp", str(a.nproc), "--device", a.device, "--param_dtype", "bfloat16",
           "--max_steps", "5", "--ckpt_every", "2", "--keep_checkpoints", "1", "--out_dir", out]
    if a.device == "cpu":
        cmd += ["--dtype", "float32", "--offload", "false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print("$", " ".join(cmd[3:]), flush=True)

    # 1. until a SIGTERM after step 3
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, t_signal = [], None
    for line in proc.stdout:
        lines.append(line)
        print("   ", line.rstrip()[:200], flush=True)
        if line.startswith("step    3") and t_signal is None:
            t_signal = time.time()  # the workers, not torchrun: as `pkill -USR1 -P <torchrun pid>` in bench/slurm.sh
            for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split():
                os.kill(int(pid), signal.SIGTERM)
    proc.wait()
    first = "".join(lines)
    t_exit = time.time()

    # 2. the same command again
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    second = p.stdout + p.stderr
    for line in p.stdout.splitlines():
        print("   ", line[:200])

    saves = [float(x) for x in re.findall(r"checkpoint: step \d+ saved to \S+ in ([\d.]+) s", first + second)]
    load = re.search(r"resumed from \S+ after step (\d+) \(loaded in ([\d.]+) s\)", second)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_dir = os.path.join(out, "checkpoints")
    last = sorted(d for d in os.listdir(steps_dir) if d.startswith("step_") and "." not in d)[-1]
    times = [r["step_time_s"] for r in rows[1:]]
    res = dict(model=a.model, nproc=a.nproc, seq_len=a.seq_len, device=a.device,
               first_exit_code_workers="75" if "Exit code 75" in first else "not seen",
               signal_to_exit_s=round(t_exit - t_signal, 1) if t_signal else None,
               save_s=saves, load_s=float(load.group(2)) if load else None,
               resumed_after_step=int(load.group(1)) if load else None,
               checkpoint_gib=round(du(os.path.join(steps_dir, last)) / 2**30, 2),
               steps=[r["step"] for r in rows], step_time_s=times, second_exit_code=p.returncode,
               first_launch_total_s=round(t_exit - t0, 1))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=2)
    print(json.dumps(res, indent=2))
    shutil.rmtree(a.root, ignore_errors=True)


if __name__ == "__main__":
    main()
