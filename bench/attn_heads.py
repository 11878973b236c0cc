"""The attention backward in groups of heads (kernels.attn_bwd, heads_per_call): time and peak memory of one
causal backward on a GPU, for each group size, at the Qwen3 shapes of the training benchmark.

    python bench/attn_heads.py                        # Qwen3-4B (32/8 heads) and 1.7B (16/8), 32k and 131k
    python bench/attn_heads.py --shapes 32:8:131072 --per_call 32,8

"peak" is max_memory_allocated during the backward over what was allocated before it (the inputs and out/lse),
so it counts dq/dk/dv and the kernel's workspace. Each group's gradients are checked against the one-call
result (bf16: the fp32 accumulation order differs, so not bit-equal).
"""
import argparse
import functools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from million.kernels import attn_bwd, attn_fwd  # noqa: E402
from ring_sim import median_seconds  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32:8:32768,32:8:131072,16:8:131072", help="Hq:Hkv:T,...")
    ap.add_argument("--per_call", default="32,16,8,4", help="query heads per kernel call")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "attn_heads.json"))
    args = ap.parse_args()
    dev, rows = torch.device("cuda"), []
    for shape in args.shapes.split(","):
        hq, hkv, t = map(int, shape.split(":"))
        gen = torch.Generator(dev).manual_seed(0)
        # [B, T, H, D] memory seen as [B, H, T, D], as the model passes them
        q, dout = (torch.randn(1, t, hq, 128, device=dev, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(2))
        k, v = (torch.randn(1, t, hkv, 128, device=dev, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        out, lse = attn_fwd(q, k, v, True)
        ref = None
        flops = 2.5 * 4 * t * t * hq * 128 / 2  # backward ~2.5x the causal forward's 4*T^2*H*D/2
        for n in map(int, args.per_call.split(",")):
            if n > hq:
                continue
            run = functools.partial(attn_bwd, dout, q, k, v, out, lse, True, heads_per_call=n)
            grads = run()
            torch.cuda.synchronize()
            if ref is None:
                ref = grads
            err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(grads, ref))
            del grads
            ms = 1e3 * median_seconds(run, dev, iters=5, warmup=1)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = run()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            del grads
            rows.append(dict(hq=hq, hkv=hkv, t=t, heads_per_call=n, ms=round(ms, 2),
                             tflops=round(flops / ms / 1e9, 1), peak_gib=round(peak, 2), rel_err_vs_first=err))
            print(rows[-1], flush=True)
        del q, k, v, dout, out, lse, ref
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), fh, indent=1)
    print(f"\n{'Hq/Hkv':>7} {'T':>7} {'heads/call':>10} {'ms':>8} {'TFLOP/s':>8} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['hq']}/{r['hkv']:<4} {r['t']:>7} {r['heads_per_call']:>10} {r['ms']:>8} {r['tflops']:>8} "
              f"{r['peak_gib']:>9}")


if __name__ == "__main__":
    main()
