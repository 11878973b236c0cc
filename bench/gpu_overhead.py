"""What a training process holds on the GPU outside PyTorch's allocator, stage by stage.

plan.py plans to GPU_MARGIN of the memory free before the model is built. What the process then takes outside the
allocator (the communicator's buffers, the libraries' handles and workspaces, loaded kernels) comes out of that
margin. This script takes the same steps train.py takes, in its order, and prints after each the memory the driver
counts as used less what the allocator holds (reserved), both in MiB:

    python -m torch.distributed.run --standalone --nproc_per_node 1 bench/gpu_overhead.py [--out FILE.json]
"""
import argparse
import datetime
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("FLA_CACHE_RESULTS", "0")  # fla's autotuner runs here, not read from an earlier run's cache

MIB = 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []

    def row(stage):
        free, total = torch.cuda.mem_get_info()
        used, reserved = (total - free) / MIB, torch.cuda.memory_reserved() / MIB
        rows.append(dict(stage=stage, used_mib=round(used), reserved_mib=round(reserved),
                         outside_mib=round(used - reserved)))
        print(f"{stage:<44} used {used:9.0f}  reserved {reserved:9.0f}  outside {used - reserved:7.0f} MiB",
              flush=True)

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    row("context (set_device, mem_get_info)")
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    row("init_process_group(nccl)")
    caps = torch.ones(2, dtype=torch.float64, device="cuda")
    dist.all_reduce(caps)  # train.py's first collective: fit.py's caps, right after it reads the free memory
    torch.cuda.synchronize()
    row("first all_reduce (the communicator)")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    row("bf16 matmul (cuBLAS handle, workspace)")
    xf = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    (xf @ xf).sum().backward()
    torch.cuda.synchronize()
    row("fp32 matmul forward + backward")
    q, k, v = (torch.randn(1, 16, 8192, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()
    row("cuDNN attention, head_dim 256, fwd + bwd")
    try:  # what qwen3_5.build runs before a run trains on fla: the start-up check at the 9B's heads, whose
        # first calls autotune fla's kernels (FLA_CACHE_RESULTS=0 below: each time, not from Triton's disk cache)
        from million import deltanet
        from million.deltanet import causal_conv, conv_disagreement, disagreement, fla_rule
        with deltanet.local_memory_returned():
            assert disagreement(fla_rule, 16, 32, 128, 128, length=16384) is None
            row("fla start-up check (autotuned)")
            assert conv_disagreement(functools.partial(causal_conv, kernel="fla"), 8192, 4, length=16384) is None
            row("... and fla's conv")
        row("local memory returned (deltanet.local_memory_returned)")
        T, H, D = 131072, 32, 128  # then the configs it kept, at a step's length (one layer of the 9B at 131k)
        qd, kd = (torch.randn(1, T, H // 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
        vd = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = F.logsigmoid(torch.randn(1, T, H, device="cuda")).requires_grad_()
        beta = torch.rand(1, T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        o, _ = fla_rule(qd, kd, vd, g, beta, final=False)
        o.float().sum().backward()
        torch.cuda.synchronize()
        del qd, kd, vd, g, beta, o
        row("fla fwd + bwd at 131,072 tokens, the kept configs")
        with deltanet.local_memory_returned():  # what qwen3_5.build adds under cp: the span summaries' form
            assert disagreement(fla_rule, 16, 32, 128, 256, length=16384) is None
            row("the rule's cp form (dv + dk value columns) autotuned")
        row("local memory returned again")
    except Exception as e:  # not installed, or refused (fla on Triton < 3.7.1 on Hopper)
        print(f"fla: {type(e).__name__}: {e}"[:200])
    try:
        from flash_attn.cute import flash_attn_func
        o = flash_attn_func(*(t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)),
                            causal=True)
        (o[0] if isinstance(o, tuple) else o).float().sum().backward()
        torch.cuda.synchronize()
        row("FA4 attention, head_dim 256, fwd + bwd")
    except Exception as e:
        print(f"FA4: {type(e).__name__}: {e}"[:200])
    f = torch.compile(lambda t: F.silu(t) * t)
    f(torch.randn(1 << 20, device="cuda")).sum().item()
    row("torch.compile'd kernel")
    del x, xf, q, k, v
    torch.cuda.empty_cache()
    row("after empty_cache")
    if a.out:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       nccl=".".join(map(str, torch.cuda.nccl.version())), rows=rows), open(a.out, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
