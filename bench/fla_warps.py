"""Which autotune configs of two of fla's gated backward kernels compute right on this GPU: each config forced in
turn, fla's rule against the torch rule (deltanet.disagreement, tolerance 0: the worst error is printed).

    python bench/fla_warps.py                   # the WY backward (wy_fast.prepare_wy_repr_bwd_kernel)
    python bench/fla_warps.py --kernel dqkwg    # dq, dk, dg (common.chunk_o.chunk_bwd_kernel_dqkwg)
    python bench/fla_warps.py --shapes          # no config forced: fla's own choice over a grid of shapes, each
                                                # shape in a process of its own (a CUDA fault ends only its row)

A GPU with fla-core 0.6 and Triton >= 3.7.1 (bench/gpu_wheels.sh). Each row recompiles the kernel, so a row takes
a minute or more.

- wy: deltanet._fla_kernel keeps only the 2-warp configs on Hopper, as fla does for the ungated twin of this kernel,
  whose 4-warp build Triton miscompiles on sm_90. Expected, if the gated kernel has the same fault: the 4-warp
  rows off by far more than bf16's 5e-3 in dk, dbeta or dg, the 2-warp rows within it.
- dqkwg: on Hopper, at dk 32, dv 48, two sequences of 296 tokens from a state, fla's dq, dk and dg are wrong
  (1.0, 13 and 39 on an H100; tests/test_qwen3_5.py) while one sequence of 4,096 tokens agrees (4.5e-3). The rows
  vary the config, the batch and the length, to say which of them the fault follows. fla's own bisection of the
  same kernel's fault below Triton 3.7.1 (fla #640) found it followed the K block width, not the config;
  here BK is 32 and BV 64 over dv 48 (a partial block), so --shapes varies dk and dv too, with fla's autotuning
  left alone (one compile per shape, not per config: much faster than forcing).
"""
import argparse
import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from million import deltanet  # noqa: E402

CASES = dict(wy=[(1, 4096, 6, 32, 48), (1, 4096, 32, 128, 128)],  # (batch, length, heads, dk, dv)
             dqkwg=[(1, 296, 6, 32, 48), (2, 296, 6, 32, 48), (1, 4096, 6, 32, 48), (2, 4096, 6, 32, 48)])
SHAPES = [(b, n, 6, dk, dv) for dk, dv in ((32, 48), (32, 64), (64, 48), (32, 32), (128, 128))
          for b, n in ((2, 296), (1, 296), (1, 4096))]  # the failing case first: rows come a minute apart


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="wy", choices=sorted(CASES))
    ap.add_argument("--warps", default="2,4", help="comma-separated num_warps to force")
    ap.add_argument("--shapes", action="store_true", help="force nothing; rows over SHAPES (dk, dv, batch, length)")
    ap.add_argument("--shape", help="one row of --shapes: batch,length,heads,dk,dv (what each child process runs)")
    ap.add_argument("--row_timeout", type=int, default=300, help="seconds for one row of --shapes (compile included)")
    a = ap.parse_args()
    if deltanet.fla_unavailable():
        sys.exit(f"fla_warps: {deltanet.fla_unavailable()}")
    if a.shape:
        batch, length, heads, dk, dv = map(int, a.shape.split(","))
        line = deltanet.disagreement(deltanet.fla_rule, heads, heads, dk, dv, tol=0, length=length, batch=batch)
        print(f"dk {dk} dv {dv} batch {batch} length {length}: {line}", flush=True)
        return
    if a.shapes:  # each row in a child: an illegal memory access (seen at dk 32, dv 64 on an H100) ends only its row
        print(torch.cuda.get_device_name(), "Triton", triton.__version__, "fla's own configs", flush=True)
        for batch, length, heads, dk, dv in SHAPES:
            cmd = [sys.executable, os.path.abspath(__file__), "--shape", f"{batch},{length},{heads},{dk},{dv}"]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.row_timeout)
                lines = [s for s in r.stderr.splitlines() if s.strip()] or [f"exit {r.returncode}"]
                why = [s for s in lines if "Error" in s] or lines  # a traceback's exception line, else the last
                out = r.stdout.strip() or f"the process failed ({why[-1].strip()})"
            except subprocess.TimeoutExpired:
                out = f"not finished in {a.row_timeout} s"
            print(out if out.startswith("dk ") else f"dk {dk} dv {dv} batch {batch} length {length}: {out}", flush=True)
        return
    from fla.ops.common import chunk_o
    from fla.ops.gated_delta_rule import wy_fast
    deltanet._fla_kernel()  # its filter first, so that it leaves the configs forced below alone
    kernel = dict(wy=wy_fast.prepare_wy_repr_bwd_kernel, dqkwg=chunk_o.chunk_bwd_kernel_dqkwg)[a.kernel]
    tuner = kernel.fn  # triton.heuristics around the autotuner
    print(torch.cuda.get_device_name(), "Triton", triton.__version__, "kernel", a.kernel, flush=True)
    for warps in (int(w) for w in a.warps.split(",")):
        for stages in (2, 3, 4):
            tuner.configs = [triton.Config({}, num_warps=warps, num_stages=stages)]
            tuner.cache.clear()  # the choice made for the previous config
            for batch, length, heads, dk, dv in CASES[a.kernel]:
                line = deltanet.disagreement(deltanet.fla_rule, heads, heads, dk, dv, tol=0, length=length,
                                             batch=batch)
                print(f"num_warps {warps} num_stages {stages} batch {batch} length {length}: {line}", flush=True)


if __name__ == "__main__":
    main()
