"""The MoE block's row permutations, before and after moe._Rows: one tile of the 35B-A3B's sparse block (16,384
tokens, top-8 of 256 experts, hidden 2048, 512 wide) forward and backward through moe.experts_grouped, with the
experts frozen (LoRA's case: only the rows' gradient) and trained. "before" is index_select under plain autograd
(its backward a scatter-add with atomics), "after" the gather-backward of _Rows. Checks that both give the same
output and gradients (bf16: relative error under 1e-2), then times each (median of CUDA-event timings). Then
the weighted sum of each token's k expert outputs both ways: a product and a sum (before), one batched product
(moe.py since 2026-12-06).

    python bench/moe_rows.py --out bench/results/moe_rows.json    # a GPU
    python bench/moe_rows.py --small --out /tmp/moe_rows.json    # the code paths on the CPU, fp32, tiny
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from million import moe  # noqa: E402


def before(x, src, back, k):  # what experts_grouped did: index_select, whose backward is an atomic scatter-add
    return x.index_select(0, src // k)


def step(ws, x, dy, train):
    """One forward and backward of the routed experts; -> (y, dx, the gate's weight gradient or None)."""
    x = x.detach().requires_grad_()
    leaves = [w.detach().requires_grad_(train) for w in ws]
    probs, weights, experts = moe.route(x, leaves[0], 8, True)
    y = moe.experts_grouped(x, weights, experts, *leaves[1:])
    grads = torch.autograd.grad(y, [x, *leaves[1:2]] if train else [x], dy)
    return y, grads[0], grads[1] if train else None


def timed(fn, iters, device):
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="CPU, fp32, a tiny block: the code paths only")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="bench/results/moe_rows.json")
    a = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if a.small else ("cuda", torch.bfloat16)
    N, H, I, E = (64, 32, 16, 8) if a.small else (16384, 2048, 512, 256)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    ws = [rand(E, H, scale=0.02), rand(E, I, H, scale=0.02), rand(E, I, H, scale=0.02), rand(E, H, I, scale=0.02)]
    x, dy = rand(N, H, scale=1.0), rand(N, H, scale=1.0)
    rows = {}
    for train in (False, True):
        runs = {}
        for name, fn in (("before", before), ("after", moe._Rows.apply)):
            keep, moe._Rows.apply = moe._Rows.apply, fn
            try:
                runs[name] = step(ws, x, dy, train)
                runs[name + "_s"] = timed(lambda: step(ws, x, dy, train), a.iters, device)
            finally:
                moe._Rows.apply = keep
        errs = [rel(p, q) for p, q in zip(runs["after"], runs["before"]) if p is not None]
        assert max(errs) < (1e-5 if a.small else 1e-2), errs
        key = "experts trained" if train else "experts frozen"
        rows[key] = dict(before_ms=runs["before_s"] * 1e3, after_ms=runs["after_s"] * 1e3, rel_err=errs)
        print(f"{key:<16} before {runs['before_s'] * 1e3:8.2f} ms  after {runs['after_s'] * 1e3:8.2f} ms  "
              f"(y, dx, dw_gate relative differences: {', '.join(f'{e:.1e}' for e in errs)})")
    # the experts' outputs weighted and summed by one batched product (moe.py's), which reads the [N*k, H] rows
    # once, against the product then the sum (each materialising [N*k, H] again, both ways)
    y, w = rand(N * 8, H, scale=1.0), torch.softmax(rand(N, 8, scale=1.0).float(), -1).to(dtype)
    combine = {}
    for name, fn in (("mul_sum", lambda y, w: (y.view(N, 8, -1) * w[..., None]).sum(1)),
                     ("bmm", lambda y, w: torch.bmm(w.unsqueeze(1), y.view(N, 8, -1)).squeeze(1))):
        def run(fn=fn):
            leaves = [y.detach().requires_grad_(), w.detach().requires_grad_()]
            out = fn(*leaves)
            return (out, *torch.autograd.grad(out, leaves, dy))
        combine[name] = run()
        combine[name + "_s"] = timed(run, a.iters, device)
    errs = [rel(p, q) for p, q in zip(combine["bmm"], combine["mul_sum"])]
    assert max(errs) < (1e-5 if a.small else 2e-2), errs
    rows["combine"] = dict(mul_sum_ms=combine["mul_sum_s"] * 1e3, bmm_ms=combine["bmm_s"] * 1e3, rel_err=errs)
    print(f"{'combine':<16} mul+sum {combine['mul_sum_s'] * 1e3:7.2f} ms  bmm {combine['bmm_s'] * 1e3:8.2f} ms  "
          f"(out, dy, dw relative differences: {', '.join(f'{e:.1e}' for e in errs)})")
    out = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", tokens=N, hidden=H,
               moe_intermediate=I, experts=E, top_k=8, dtype=str(dtype), rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    json.dump(out, open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
