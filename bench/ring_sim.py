"""Zigzag ring attention simulated in one process: checks the attention kernels the ring uses and times them.

    python bench/ring_sim.py            # H200: cp 8 over 131,072 tokens, 32 q / 8 kv heads, d 128, bf16 (~1 min)
    python bench/ring_sim.py --small    # any machine: a tiny fp32 shape on CPU, exercises every code path

One process plays all cp ranks. Rank r's ring steps call parallel._fwd_block and parallel._bwd_block on the
blocks of its parallel.Schedule, as the real ring does (bench/doc_balance.py times them per rank under document
masks), with the K/V that rank r would hold at step i (rank
r - i's shard) taken by slicing instead of being received, and each block's dK/dV added into the source rank's
fp32 buffer instead of travelling.
The gathered output and dq/dk/dv are compared with one causal F.scaled_dot_product_attention call (enable_gqa,
autograd) on the whole sequence: max abs and relative Frobenius error. Then the blocks of all cp ranks together
are timed against the one causal kernel call on the whole sequence (the same kernel, kernels.attn_fwd/attn_bwd):
forward and forward+backward, median of --iters runs after warm-up (CUDA events). efficiency = single / ring;
TFLOP/s counts causal attention FLOPs (forward 2*2*B*Hq*D*L*L/2, backward 2.5x forward) for both.
Writes JSON (--out, default bench/results/ring_sim.json) and prints a table; exits 1 if an error is too large.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from million.kernels import Kernels, attn_bwd, attn_fwd  # noqa: E402
from parallel import _acc, _bwd_block, _fwd_block, cp_shard, cp_unshard, zigzag_schedule  # noqa: E402


def rank_forward(qs, ks, vs, r, schedule=zigzag_schedule, kernels=None):
    """Rank r's ring forward, as parallel._ring_fwd runs it: the blocks of schedule(r, cp, T) (parallel.Schedule) at
    each step up to its last, with the K/V of rank r - i at step i, on kernels (default: Kernels()).
    -> (out in q.dtype, lse)."""
    cp, q, kernels = len(qs), qs[r], kernels or Kernels()
    s = schedule(r, cp, q.shape[2])
    if s.one_block():
        return s.fwd(q, ks[r], vs[r], s.steps[0][0][2], kernels)
    out = lse = None
    for i in range(s.last + 1):
        src = (r - i) % cp
        for block in s.steps[i]:
            out, lse = _fwd_block(q, ks[src], vs[src], out, lse, block, s, kernels)
    return out.to(q.dtype), lse


def rank_backward(douts, qs, ks, vs, fwd_r, r, dks, dvs, schedule=zigzag_schedule, kernels=None):
    """Rank r's ring backward from its (out, lse): returns its fp32 dq and adds each block's dK/dV into the source
    rank's fp32 buffer in dks/dvs (in the real ring those buffers travel back to their owner)."""
    cp, q, kernels = len(qs), qs[r], kernels or Kernels()
    s = schedule(r, cp, q.shape[2])
    out, lse = fwd_r
    if s.one_block():
        dq, dk, dv = s.bwd(douts[r], q, ks[r], vs[r], out, lse, s.steps[0][0][2], kernels)
        dks[r] += dk
        dvs[r] += dv
        return dq
    dq = torch.zeros_like(q, dtype=_acc(q))
    for i in range(s.last + 1):
        src = (r - i) % cp
        for block in s.steps[i]:
            cols, dk_b, dv_b = _bwd_block(douts[r], q, ks[src], vs[src], out, lse, dq, block, s, kernels)
            dks[src][:, :, cols] += dk_b
            dvs[src][:, :, cols] += dv_b
    return dq


def ring_forward(qs, ks, vs, schedule=zigzag_schedule, kernels=None):
    """Every rank's ring forward. qs[r] [B, Hq, T, D], ks[r]/vs[r] [B, Hkv, T, D] -> [(out in q.dtype, lse)]."""
    return [rank_forward(qs, ks, vs, r, schedule, kernels) for r in range(len(qs))]


def ring_backward(douts, qs, ks, vs, fwd, schedule=zigzag_schedule, kernels=None):
    """Every rank's ring backward from the final (out, lse) of ring_forward -> fp32 dq, dk, dv per rank."""
    dks = [torch.zeros_like(k, dtype=_acc(k)) for k in ks]
    dvs = [torch.zeros_like(v, dtype=_acc(v)) for v in vs]
    dqs = [rank_backward(douts, qs, ks, vs, fwd[r], r, dks, dvs, schedule, kernels) for r in range(len(qs))]
    return dqs, dks, dvs


def errors(got, ref):
    got, ref = got.double(), ref.double()
    return {"max_abs": (got - ref).abs().max().item(), "rel_fro": ((got - ref).norm() / ref.norm()).item()}


def median_seconds(fn, device, iters, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_name(device, dtype):
    """Which kernel attn_fwd picks here (it falls back to flash where cuDNN raises)."""
    if device.type == "cpu":
        return "flash_for_cpu"
    x = torch.zeros(1, 1, 128, 128, device=device, dtype=dtype)
    try:
        torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, True)
        return "cudnn"
    except RuntimeError:
        return "flash"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="L 256, cp 4, 4 q / 2 kv heads, d 16, fp32, CPU")
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=131072)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="default bench/results/ring_sim.json (ring_sim_small.json)")
    args = p.parse_args()
    if args.small:
        device, dtype, b, hq, hkv, d, cp, seq = torch.device("cpu"), torch.float32, 1, 4, 2, 16, 4, 256
        tol = {"out": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5}
    else:
        device, dtype, b, hq, hkv, d, cp, seq = torch.device("cuda"), torch.bfloat16, 1, 32, 8, 128, args.cp, args.seq_len
        tol = {"out": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}  # bf16 inputs and outputs
    out_path = args.out or ("bench/results/ring_sim_small.json" if args.small else "bench/results/ring_sim.json")

    torch.manual_seed(0)
    q = torch.randn(b, hq, seq, d, device=device, dtype=dtype)
    k, v, = (torch.randn(b, hkv, seq, d, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    qs, ks, vs, douts = ([cp_shard(x, 2, r, cp) for r in range(cp)] for x in (q, k, v, dout))

    # Accuracy: the simulated ring against one SDPA call with autograd on the whole sequence.
    fwd = ring_forward(qs, ks, vs)
    dqs, dks, dvs = ring_backward(douts, qs, ks, vs, fwd)
    got = {"out": cp_unshard([o for o, _ in fwd], 2)}
    for name, shards in (("dq", dqs), ("dk", dks), ("dv", dvs)):
        got[name] = cp_unshard([s.to(dtype) for s in shards], 2)  # the ring returns grads in q.dtype
    del fwd, dqs, dks, dvs
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    ref_out.backward(dout)
    ref = {"out": ref_out.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    err = {name: errors(got[name], ref[name]) for name in ref}
    del got, ref, ref_out, qr, kr, vr

    # Speed: all ranks' blocks and merges vs the one causal kernel call they replace.
    def single_fwd_bwd():
        out, lse = attn_fwd(q, k, v, True)
        return attn_bwd(dout, q, k, v, out, lse, True)

    sec = {
        ("fwd", "single"): median_seconds(lambda: attn_fwd(q, k, v, True), device, args.iters, args.warmup),
        ("fwd", "ring"): median_seconds(lambda: ring_forward(qs, ks, vs), device, args.iters, args.warmup),
        ("fwd+bwd", "single"): median_seconds(single_fwd_bwd, device, args.iters, args.warmup),
        ("fwd+bwd", "ring"): median_seconds(
            lambda: ring_backward(douts, qs, ks, vs, ring_forward(qs, ks, vs)), device, args.iters, args.warmup),
    }
    fwd_flops = 4 * b * hq * d * seq * seq / 2
    flops = {"fwd": fwd_flops, "fwd+bwd": 3.5 * fwd_flops}

    kernel = kernel_name(device, dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"ring_sim: {name}, kernel {kernel}, torch {torch.__version__}, L {seq:,}, cp {cp}, "
          f"B {b}, Hq {hq}, Hkv {hkv}, D {d}, {dtype}")
    print(f"{'':8} {'what':>10} {'ms':>10} {'TFLOP/s':>9} {'efficiency':>11}")
    timing = {}
    for what in ("fwd", "fwd+bwd"):
        single, ring = sec[(what, "single")], sec[(what, "ring")]
        timing[what] = {"single_ms": single * 1e3, "ring_ms": ring * 1e3, "ring_ms_per_rank": ring * 1e3 / cp,
                        "single_tflops": flops[what] / single / 1e12, "ring_tflops": flops[what] / ring / 1e12,
                        "efficiency": single / ring}
        t = timing[what]
        print(f"{what:8} {'single':>10} {t['single_ms']:10.1f} {t['single_tflops']:9.1f}")
        print(f"{'':8} {f'ring x{cp}':>10} {t['ring_ms']:10.1f} {t['ring_tflops']:9.1f} {t['efficiency']:11.3f}")
    print(f"{'error vs SDPA':14} {'max abs':>10} {'rel fro':>10} {'tolerance':>10}")
    for nm, e in err.items():
        print(f"{nm:14} {e['max_abs']:10.2e} {e['rel_fro']:10.2e} {tol[nm]:10.0e}")
    ok = all(err[nm]["rel_fro"] <= tol[nm] for nm in err)

    result = {"device": name, "kernel": kernel, "torch": torch.__version__, "seq_len": seq, "cp": cp, "batch": b,
              "q_heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype), "iters": args.iters,
              "warmup": args.warmup, "timing": timing, "error_vs_sdpa": err, "rel_fro_tolerance": tol, "ok": ok}
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}; errors {'within' if ok else 'OVER'} tolerance")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
