"""One LoRA projection at long context, forward and backward, in three forms, on the GPU:

- `separate`: y = x W^T + B(A(x)) * alpha/r, as PEFT writes it: three elementwise passes over [T, out] (the
  product's output, its scaling, the sum) and, backward, a scaling pass over dy;
- `addmm`: y = addmm(x W^T, A(x) * alpha/r, B^T): the scale on the [T, r] intermediate, the sum in the GEMM's
  epilogue; out of place, so torch first copies x W^T into the result;
- `inplace` (lora.LoRALinear): the same, y.addmm_(...): no copy;

beside the frozen projection alone (forward, and the backward's dX GEMM). Qwen3-8B's widths, bf16, rank 16, the
frozen weight without gradient, the adapters and x with. Median of --repeat after a warm-up, CUDA events.

    python bench/lora_linear.py --tokens 131072 --out /tmp/lora_linear.json
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def separate(x, w, a, b, s):
    return F.linear(x, w) + F.linear(F.linear(x, a), b) * s


def addmm(x, w, a, b, s):
    y = F.linear(x, w)
    return torch.addmm(y.flatten(0, -2), (F.linear(x, a) * s).flatten(0, -2), b.t()).view(y.shape)


def inplace(x, w, a, b, s):
    x2 = x.flatten(0, -2)  # as LoRALinear: rows first, so that addmm_ writes a tensor that is not a view
    return F.linear(x2, w).addmm_(F.linear(x2, a) * s, b.t()).view(*x.shape[:-1], w.shape[0])


def frozen(x, w, a, b, s):
    return F.linear(x, w)


def timed(fn, x, w, a, b, s, dy, repeat):
    times = []
    for i in range(repeat + 2):
        for t in (x, a, b):
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, w, a, b, s).backward(dy)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default="/tmp/lora_linear.json")
    a_ = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/lora_linear.py times CUDA GEMMs: run it on a GPU machine")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, s = [], 2.0
    for n_in, n_out in ((4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)):
        x = torch.randn(1, a_.tokens, n_in, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g) / n_in ** 0.5
        a = (torch.randn(a_.rank, n_in, device="cuda", dtype=torch.bfloat16, generator=g) / n_in ** 0.5).requires_grad_()
        b = (torch.randn(n_out, a_.rank, device="cuda", dtype=torch.bfloat16, generator=g) / 4).requires_grad_()
        dy = torch.randn(1, a_.tokens, n_out, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():  # the two forms compute the same function
            ref = separate(x.double(), w.double(), a.double(), b.double(), s)
            err = [((f(x, w, a, b, s).double() - ref).norm() / ref.norm()).item() for f in (separate, addmm, inplace)]
        row = dict(n_in=n_in, n_out=n_out, tokens=a_.tokens, rank=a_.rank, rel_err_separate=err[0],
                   rel_err_addmm=err[1], rel_err_inplace=err[2],
                   **{f"{f.__name__}_ms": timed(f, x, w, a, b, s, dy, a_.repeat)
                      for f in (frozen, separate, addmm, inplace)})
        rows.append(row)
        print(f"{n_in:5d} -> {n_out:5d}: frozen {row['frozen_ms']:.2f} ms, separate {row['separate_ms']:.2f} ms, "
              f"addmm {row['addmm_ms']:.2f} ms, inplace {row['inplace_ms']:.2f} ms (rel err vs fp64 "
              + " / ".join(f"{e:.1e}" for e in err) + ")", flush=True)
        del x, w, a, b, dy, ref
    with open(a_.out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
