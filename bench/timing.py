"""What several bench scripts share: wall-clock timing on a device, and a train.py run of the demo preset."""
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seconds(fn, device) -> float:
    """Seconds of one fn() call, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def median_seconds(fn, device, reps) -> float:
    """Median seconds of fn() over reps calls, after one warm-up call."""
    fn()
    return statistics.median(seconds(fn, device) for _ in range(reps))


def demo_run(out: str, name: str, flags, threads: int, show: str):
    """python train.py --config demo --out_dir out *flags, on OMP_NUM_THREADS threads; prints the lines of its
    output that start with `show` and its time; stops the script with train.py's output if it fails."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", "demo", "--out_dir", out, *map(str, flags)]
    print("$ " + " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                       cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    print("\n".join("  " + x for x in p.stdout.splitlines() if x.startswith(show)))
    print(f"  ({time.time() - t0:.0f} s)", flush=True)
