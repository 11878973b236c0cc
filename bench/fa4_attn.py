"""FlashAttention-4 against cuDNN at the training shapes, one GPU, through the functions the ring calls
(kernels.attn_fwd / attn_bwd with a backend).

    python bench/fa4_attn.py                        # H200: Qwen3-4B heads (32 q / 8 kv, d 128), bf16, ~1.5 min
    python bench/fa4_attn.py --seq_len 8192 --iters 2   # a quick look
    python bench/fa4_attn.py --heads 16:4 --head_dim 256 --out bench/results/fa4_attn_d256.json   # Qwen3.5
    python bench/fa4_attn.py --small                # any machine: tiny shapes on CPU (the CPU kernels), the code paths

Shapes: the causal diagonal block at --seq_len (one call on a whole 131k sequence, or a ring's step 0), and a
ring's non-causal off-diagonal block, q seq_len/2 x kv seq_len. Per backend: the first call of each kernel
(compilation included: FA4 compiles each variant on its first call), then forward and forward+backward, median of
--iters after a warm-up (CUDA events), and the backward's peak memory and time for several query heads per kernel
call (parallel.BWD_QUERY_HEADS_PER_CALL; "peak" is max_memory_allocated during the backward over what was
allocated before it: dq/dk/dv plus the kernel's workspace). TFLOP/s count forward 4*B*Hq*D*Tq*Tk (halved when
causal) and backward 2.5x forward. Writes --out (bench/results/fa4_attn.json).
"""
import argparse
import functools
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from million import kernels  # noqa: E402
import parallel  # noqa: E402
from ring_sim import median_seconds  # noqa: E402


def bthd(b, h, t, d, gen):
    """[B, T, H, D] memory seen as [B, H, T, D], as the model passes q, k, v."""
    return torch.randn(b, t, h, d, device=gen.device, generator=gen).to(torch.bfloat16).transpose(1, 2)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall(fn):
    sync()
    t0 = time.perf_counter()
    res = fn()
    sync()
    return res, time.perf_counter() - t0


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="fa4,cudnn")
    ap.add_argument("--seq_len", type=int, default=131072)
    ap.add_argument("--heads", default="32:8", help="Hq:Hkv")
    ap.add_argument("--head_dim", type=int, default=128, help="Qwen3: 128; Qwen3.5's gated attention: 256")
    ap.add_argument("--per_call", default="4,8,32", help="query heads per backward kernel call, for the memory rows")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="T 256, 8 q / 2 kv heads, on CPU")
    ap.add_argument("--out", default=None, help="default bench/results/fa4_attn.json (fa4_attn_small.json)")
    args = ap.parse_args()
    if args.small:
        args.seq_len, args.heads, args.per_call, args.iters = 256, "8:2", "4,8", 2
    out_path = args.out or os.path.join(ROOT, "bench", "results", f"fa4_attn{'_small' if args.small else ''}.json")
    dev = torch.device("cpu" if args.small else "cuda")
    hq, hkv = map(int, args.heads.split(":"))
    b, d, t = 1, args.head_dim, args.seq_len
    gen = torch.Generator(dev).manual_seed(0)
    q, dout = bthd(b, hq, t, d, gen), bthd(b, hq, t, d, gen)
    k, v = bthd(b, hkv, t, d, gen), bthd(b, hkv, t, d, gen)
    h = t // 2
    blocks = {  # name: (q rows, k/v columns, causal): the ring's two kinds of block
        f"causal {t}": (slice(None), slice(None), True),
        f"non-causal {h}x{t}": (slice(h, None), slice(None), False),
    }
    rows, ref = [], {}
    for backend in args.backends.split(","):
        for name, (qr, kc, causal) in blocks.items():
            qb, kb, vb, db = q[:, :, qr], k[:, :, kc], v[:, :, kc], dout[:, :, qr]
            fwd = functools.partial(kernels.attn_fwd, qb, kb, vb, causal, backend)
            (out, lse), first_fwd = wall(fwd)
            bwd = functools.partial(kernels.attn_bwd, db, qb, kb, vb, out, lse, causal, backend=backend)
            grads, first_bwd = wall(bwd)
            if name not in ref:
                ref[name] = (out, grads[0])
            err = {"out": rel(out, ref[name][0]), "dq": rel(grads[0], ref[name][1])}
            del grads

            def fwd_bwd():
                o, l = fwd()
                return kernels.attn_bwd(db, qb, kb, vb, o, l, causal, backend=backend)

            fwd_s = median_seconds(fwd, dev, args.iters, 1)
            both_s = median_seconds(fwd_bwd, dev, args.iters, 1)
            flops = 4 * b * hq * d * qb.shape[2] * kb.shape[2] / (2 if causal else 1)
            row = dict(backend=backend, block=name, first_fwd_s=round(first_fwd, 2), first_bwd_s=round(first_bwd, 2),
                       fwd_ms=round(fwd_s * 1e3, 2), fwd_bwd_ms=round(both_s * 1e3, 2),
                       fwd_tflops=round(flops / fwd_s / 1e12, 1), fwd_bwd_tflops=round(3.5 * flops / both_s / 1e12, 1),
                       rel_diff_vs_first_backend=err, bwd_by_heads_per_call=[])
            for n in map(int, args.per_call.split(",")):
                run = functools.partial(kernels.attn_bwd, db, qb, kb, vb, out, lse, causal, heads_per_call=n,
                                        backend=backend)
                run()  # compiles a new variant where the head count is part of it
                sync()
                if dev.type == "cuda":
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                grads = run()
                sync()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev.type == "cuda" else 0.0
                del grads
                ms = median_seconds(run, dev, args.iters, 0) * 1e3
                row["bwd_by_heads_per_call"].append(dict(heads_per_call=n, peak_gib=round(peak, 2), ms=round(ms, 2)))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del out, lse
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    print(f"\n{'backend':8} {'block':26} {'fwd TF/s':>9} {'f+b TF/s':>9} {'fwd ms':>8} {'f+b ms':>8} "
          f"{'1st fwd s':>9} {'1st bwd s':>9}  bwd peak GiB / ms by heads per call")
    for r in rows:
        per = ", ".join(f"{x['heads_per_call']}: {x['peak_gib']} / {x['ms']:.0f}" for x in r["bwd_by_heads_per_call"])
        print(f"{r['backend']:8} {r['block']:26} {r['fwd_tflops']:9.1f} {r['fwd_bwd_tflops']:9.1f} {r['fwd_ms']:8.1f} "
              f"{r['fwd_bwd_ms']:8.1f} {r['first_fwd_s']:9.2f} {r['first_bwd_s']:9.2f}  {per}")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as fh:
        device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        json.dump(dict(device=device, torch=torch.__version__, seq_len=t, q_heads=hq, kv_heads=hkv, head_dim=d,
                       iters=args.iters, default_heads_per_call=parallel.BWD_QUERY_HEADS_PER_CALL, rows=rows),
                  fh, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
