"""Benchmark of loss.chunked_nll against the naive full-logits cross-entropy: time, memory, gradient error.

    python bench/bench_loss.py                 # GPU: 16,384 rows x V 151,936 x H 4,096, bf16 (40 s on an H200)
    python bench/bench_loss.py --small         # any machine: a tiny shape that exercises every code path

For each chunk size and for the naive path (bf16 logits, F.cross_entropy on .float(), autograd) it reports the
median fwd+bwd time of `(loss_sum / n_valid).backward()` over --iters runs after warm-up (CUDA events), the
peak memory allocated beyond the inputs and their preallocated .grad buffers, and the error of the loss,
grad_hidden and grad_weight relative to an fp32 reference computed a chunk of rows at a time (relative
Frobenius norm). The last line, `gemm floor`, times the three bf16 matmuls alone (logits, dH, dW) at the same
shape: no loss built on them runs faster on this card. Writes JSON (--out, default bench/results/loss.json).

Measured on one H200 (torch 2.11, cuBLAS), this script as is:

    method         ms median   ms min  peak GiB  loss err    dH err    dW err
    chunked 1024       113.6    110.5      3.60   4.5e-07   2.0e-03   1.6e-03
    chunked 2048       109.7    107.4      4.20   5.2e-07   2.0e-03   1.6e-03
    chunked 4096       106.7    103.4      5.95   5.2e-07   2.0e-03   1.6e-03
    chunked 8192       104.3    102.7      9.46   5.2e-07   2.0e-03   1.6e-03
    naive              120.3    117.3     27.82   9.0e-07   2.0e-03   1.8e-03
    gemm floor          91.7   (3 bf16 matmuls of the shape, no softmax)

Where the chunked time goes (torch.profiler, chunks of 4,096): the three GEMMs 88 ms, the fused softmax 10 ms,
backward's scale-and-round of grad_weight 3 ms. The peak is the fp32 grad_weight accumulator (2.32 GiB) plus
6 B per element of one [chunk, V] block (fp32 logits while bf16 dlogits are written: 1.74 GiB at 2,048), or,
for small chunks, that accumulator plus its bf16 rounding (1.16 GiB) at the start of backward.
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
from loss import chunked_nll  # noqa: E402


def naive_nll(hidden, weight, labels):
    """The path the chunked loss replaces: [N, V] bf16 logits, an fp32 copy for the softmax, autograd backward."""
    logits = hidden @ weight.T                                                                  # [N, V]
    return F.cross_entropy(logits.float(), labels, reduction="sum"), (labels != -100).sum()


def reference_grads(hidden, weight, labels, chunk):
    """fp32 loss, grad_hidden, grad_weight from fp32 copies of the inputs, a chunk of rows at a time (fits memory)."""
    w = weight.detach().float().requires_grad_()
    loss, dh = torch.zeros((), dtype=torch.float64, device=hidden.device), torch.zeros_like(hidden, dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk].detach().float().requires_grad_()
        l = F.cross_entropy(h @ w.T, labels[s:s + chunk], reduction="sum")
        l.backward()
        dh[s:s + chunk] = h.grad
        loss += l.detach().double()
    return loss, dh, w.grad


def rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(fn, hidden, weight, labels, iters, warmup):
    """Median and min milliseconds of one fwd+bwd, grads accumulating into preallocated .grad buffers."""
    def step():
        loss, n = fn(hidden, weight, labels)
        (loss / n).backward()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if hidden.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), min(times)


def peak_extra_gib(fn, hidden, weight, labels):
    """Peak memory allocated during one fwd+bwd, beyond what is allocated before it (inputs and their grads)."""
    if not hidden.is_cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, n = fn(hidden, weight, labels)
    (loss / n).backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gemm_floor_ms(hidden, weight, iters, warmup):
    """The three matmuls of a fused loss, alone, in bf16: logits [N, V], dH = g @ W, dW = g.T @ h."""
    if not hidden.is_cuda:
        return None
    h, w = hidden.detach(), weight.detach()
    g = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)                     # [N, V]
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(h, w.T, out=g)
        g @ w
        g.T @ h
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    del g
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shape (N 300, V 1,001, H 64), runs anywhere")
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/loss.json")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.small:
        N, V, H, chunks, iters = 300, 1001, 64, [7, 64, 512], min(args.iters, 3)
    else:
        if device.type != "cuda":
            sys.exit("the full shape needs a GPU (16,384 x 151,936 bf16 logits are 5 GB); use --small on CPU")
        N, V, H, chunks, iters = 16_384, 151_936, 4_096, args.chunks, args.iters
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(args.seed)
    hidden = torch.randn(N, H, device=device, dtype=dtype, generator=g).requires_grad_()                # [N, H]
    # logits of std ~1.3 at any H: 0.02 at H = 4,096, as a trained head's weights
    weight = (1.28 / H**0.5 * torch.randn(V, H, device=device, generator=g)).to(dtype).requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (N,), device=device, generator=g)                                      # [N]
    labels[::1000] = -100  # a few ignored rows, as at document ends

    ref_loss, ref_dh, ref_dw = reference_grads(hidden, weight, labels, chunk=min(N, 4096))
    n_valid = int((labels != -100).sum())
    ref_dh, ref_dw = ref_dh / n_valid, ref_dw / n_valid  # the timed steps backward loss_sum / n_valid
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)

    methods = [(f"chunked {c}", c, lambda h, w, y, c=c: chunked_nll(h, w, y, chunk_size=c)) for c in chunks]
    methods.append(("naive", None, naive_nll))
    rows = []
    for name, chunk, fn in methods:
        hidden.grad.zero_()
        weight.grad.zero_()
        loss, n = fn(hidden, weight, labels)
        (loss / n).backward()
        errs = dict(loss_rel_err=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                    grad_hidden_rel_err=rel_err(hidden.grad, ref_dh), grad_weight_rel_err=rel_err(weight.grad, ref_dw))
        ms, ms_min = time_fwd_bwd(fn, hidden, weight, labels, iters, args.warmup)
        rows.append(dict(method=name, chunk_size=chunk, ms_median=ms, ms_min=ms_min,
                         peak_extra_gib=peak_extra_gib(fn, hidden, weight, labels), **errs))
    floor = gemm_floor_ms(hidden, weight, iters, args.warmup)

    result = dict(shape=dict(rows=N, vocab=V, hidden=H, dtype=str(dtype), ignored=N - n_valid),
                  device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, gemm_floor_ms=floor, rows=rows)
    print(f"{N} rows x V {V} x H {H}, {dtype}, {result['device']}, torch {torch.__version__}")
    print(f"{'method':<14}{'ms median':>10}{'ms min':>9}{'peak GiB':>10}{'loss err':>10}{'dH err':>10}{'dW err':>10}")
    for r in rows:
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"  # CUDA only
        print(f"{r['method']:<14}{r['ms_median']:>10.1f}{r['ms_min']:>9.1f}{peak:>10}"
              f"{r['loss_rel_err']:>10.1e}{r['grad_hidden_rel_err']:>10.1e}{r['grad_weight_rel_err']:>10.1e}")
    if floor is not None:
        print(f"{'gemm floor':<14}{floor:>10.1f}   (3 bf16 matmuls of the shape, no softmax)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
