"""The real ring over NCCL (parallel.RingAttention, one process per GPU) against one kernel call on the whole
sequence, for each attention backend: speed and agreement.

    torchrun --standalone --nproc_per_node 2 bench/fa4_ring.py                  # 262,144 tokens, fa4 and cudnn
    torchrun --standalone --nproc_per_node 2 bench/fa4_ring.py --seq_len 16384 --iters 2
    torchrun --standalone --nproc_per_node 2 bench/fa4_ring.py --small      # any machine: CPU, gloo, tiny

Every rank draws the same whole q, k, v, dout (32 q / 8 kv heads, d 128, bf16, in the model's [B, T, H, D] memory)
and keeps its zigzag shard. The ring's forward+backward is timed on every rank (median of --iters after a warm-up,
CUDA events, a barrier before each); then rank 0 runs one causal kernel call on the whole sequence with the same
backend, forward+backward, and compares the gathered ring output and gradients with it (both bf16, so the
difference is two roundings, not an error of either). ideal = single / cp; efficiency = ideal / ring.
Writes --out (rank 0; bench/results/fa4_ring.json).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from million import kernels  # noqa: E402
import parallel  # noqa: E402
from fa4_attn import rel  # noqa: E402
from ring_sim import median_seconds  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="fa4,cudnn")
    ap.add_argument("--seq_len", type=int, default=262144)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="T 1024, 8 q / 2 kv heads, on CPU under gloo")
    ap.add_argument("--out", default=None, help="default bench/results/fa4_ring.json (fa4_ring_small.json)")
    args = ap.parse_args()
    out_path = args.out or os.path.join(ROOT, "bench", "results", f"fa4_ring{'_small' if args.small else ''}.json")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.small:
        dev, (hq, hkv, d, t), args.backends = torch.device("cpu"), (8, 2, 64, 1024), "auto"
        dist.init_process_group("gloo")
    else:
        dev, (hq, hkv, d, t) = torch.device("cuda"), (32, 8, 128, args.seq_len)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    group, gen = dist.group.WORLD, torch.Generator(dev).manual_seed(0)
    whole = [torch.randn(1, t, h, d, device=dev, generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv, hq)]
    q, k, v, dout = (parallel.cp_shard(x, 1, rank, world).transpose(1, 2) for x in whole)  # [B, H, T/cp, D]
    if rank != 0:
        del whole
    results = []
    for backend in args.backends.split(","):
        attn = parallel.RingAttention(group, kernels.Kernels(backend))

        def ring():
            dist.barrier()
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = attn(*leaves)
            out.backward(dout)
            return out.detach(), *(x.grad for x in leaves)

        ring_s = median_seconds(ring, dev, args.iters, 1)
        got = ring()
        gathered = []
        for x in got:  # [B, H, T/cp, D] shards -> rank 0's whole [B, H, T, D]
            x = x.contiguous()  # a collective writes raw bytes: the receive buffers must be contiguous too
            parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
            dist.gather(x, parts, dst=0)
            gathered.append(parallel.cp_unshard(parts, 2) if rank == 0 else None)
        del got
        if rank == 0:
            wq, wk, wv, wd = (x.transpose(1, 2) for x in whole)

            def single():
                out, lse = kernels.attn_fwd(wq, wk, wv, True, attn.kernels.backend)
                return out, *kernels.attn_bwd(wd, wq, wk, wv, out, lse, True, backend=attn.kernels.backend)

            single_s = median_seconds(single, dev, args.iters, 1)
            ref = single()
            diff = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), gathered, ref)}
            del ref
            flops = 3.5 * 4 * hq * d * t * t / 2
            row = dict(backend=attn.kernels.backend, cp=world, seq_len=t, ring_s_per_rank=round(ring_s, 3),
                       single_s=round(single_s, 3), ideal_s=round(single_s / world, 3),
                       efficiency=round(single_s / world / ring_s, 3),
                       ring_tflops_per_gpu=round(flops / world / ring_s / 1e12, 1),
                       single_tflops=round(flops / single_s / 1e12, 1), rel_diff_vs_single=diff)
            results.append(row)
            print(json.dumps(row), flush=True)
        del gathered
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as fh:
            device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
            json.dump(dict(device=device, torch=torch.__version__, q_heads=hq, kv_heads=hkv, head_dim=d,
                           iters=args.iters, rows=results), fh, indent=1)
        print(f"wrote {out_path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
