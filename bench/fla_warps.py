"""Which autotune configs of fla's gated WY backward kernel (fla.ops.gated_delta_rule.wy_fast.
prepare_wy_repr_bwd_kernel) compute right on this GPU: each config forced in turn, fla's rule against the torch rule
(deltanet.disagreement) at the tiny GPU model test's head dims and at the 9B's.

    python bench/fla_warps.py          # a GPU with fla-core 0.6 and Triton >= 3.7.1 (bench/gpu_wheels.sh)

deltanet._fla_rule keeps only the 2-warp configs on Hopper, as fla does for the ungated twin of this kernel, whose
4-warp build Triton miscompiles on sm_90. This shows whether the gated kernel has the same fault: expected, the
4-warp rows off by far more than bf16's 5e-3 in dk, dbeta or dg, and the 2-warp rows within it.
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from million import deltanet  # noqa: E402


def main():
    if deltanet.fla_unavailable():
        sys.exit(f"fla_warps: {deltanet.fla_unavailable()}")
    from fla.ops.gated_delta_rule import wy_fast
    deltanet._fla_rule()  # its filter first, so that it leaves the configs forced below alone
    tuner = wy_fast.prepare_wy_repr_bwd_kernel.fn
    print(torch.cuda.get_device_name(), "Triton", triton.__version__)
    for warps in (2, 4):
        for stages in (2, 3, 4):
            tuner.configs = [triton.Config({}, num_warps=warps, num_stages=stages)]
            tuner.cache.clear()  # the choice made for the previous config
            for heads, dk, dv in ((6, 32, 48), (32, 128, 128)):
                line = deltanet.disagreement(deltanet.fla_chunk_gated_delta_rule, heads, dk, dv, tol=0, length=4096)
                print(f"num_warps {warps} num_stages {stages} heads {heads} dk {dk} dv {dv}: {line}", flush=True)


if __name__ == "__main__":
    main()
