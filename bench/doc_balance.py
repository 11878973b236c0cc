"""Packed documents under the ring: each rank's attention time, the balanced layout against the simple path, and
whole training steps on documents of set lengths against one sequence of the same length.

    python bench/doc_balance.py attn                        # one GPU plays cp 2 at 262,144 tokens (~2 min)
    python bench/doc_balance.py steps --nproc 1             # train.py at 131,072 tokens on one GPU (~8 min)
    python bench/doc_balance.py steps --nproc 2 --seq_len 262144 --model qwen3-8b   # the 2-GPU table
    python bench/doc_balance.py attn --small                # CPU, tiny shapes: every path runs

Windows (CASES): one document (the whole window: today's ring), 4 equal documents, 32 equal documents, and "mixed":
log-normal lengths (median 1/64 of the window, sigma 1.5, seed 0; the longest a large share of it), cut to fill
the window.

attn: per model shape (query and K/V heads of Qwen3-1.7B and -8B, head_dim 128, bf16) and window, one process
plays every rank of the ring (bench/ring_sim.py's rank_forward and rank_backward: the blocks, the kernels and the
merges the real ring runs, K/V sliced instead of received) and times each rank's forward and backward of one layer
(CUDA events, median of --iters after a warm-up that includes FA4's compilation), for `balanced` (the layout by
masked area, a rank's documents in one variable-length call) and `simple` (zigzag, a call per document piece). The
balanced and simple outputs are compared (they compute the same thing). Rank imbalance = slowest rank / mean - 1.
steps: train.py (--fit auto, random init, byte tokenizer) on a .jsonl of text rows of exactly the case's lengths
(--packing docs: each row one document), balanced and simple, and on one sequence (--packing concat) of the same
length; s/step is the median after the first step. The cost model's prediction for each run is plan.step_seconds
with the levers the run chose and its attn_area (the busiest rank's masked area, from metrics.jsonl).
"""
import argparse
import functools
import json
import os
import random
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from million import documents  # noqa: E402
from million import hf  # noqa: E402
from million import kernels  # noqa: E402
import parallel  # noqa: E402
from million import plan  # noqa: E402
from packed_docs import run  # noqa: E402
from ring_sim import median_seconds, rank_backward, rank_forward  # noqa: E402

SHAPES = {"qwen3-1.7b": (16, 8), "qwen3-8b": (32, 8)}  # query heads, K/V heads (head_dim 128)


def long_tailed(total, seed, median=4096, sigma=1.5):
    """Document lengths drawn from a log-normal (most short, a few as long as the window), cut to fill `total`."""
    rng, lens = random.Random(seed), []
    while sum(lens) < total:
        lens.append(min(max(1, int(rng.lognormvariate(0, sigma) * median)), total - sum(lens)))
    return tuple(lens)


def cases(seq_len):
    return {"one document": (seq_len,), "4 documents": (seq_len // 4,) * 4, "32 documents": (seq_len // 32,) * 32,
            "mixed": long_tailed(seq_len, 0, median=seq_len // 64)}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def attn(a):
    device = torch.device("cpu" if a.small else "cuda")
    dtype = torch.float32 if a.small else torch.bfloat16
    seq, d = (256, 16) if a.small else (a.seq_len, 128)
    shapes = {"tiny": (4, 2)} if a.small else SHAPES
    results = []
    for model, (hq, hkv) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        q, dout = (torch.randn(1, seq, hq, d, generator=gen, device=device, dtype=dtype).transpose(1, 2)
                   for _ in range(2))
        k, v = (torch.randn(1, seq, hkv, d, generator=gen, device=device, dtype=dtype).transpose(1, 2)
                for _ in range(2))
        for case, lens in cases(seq).items():
            row, outs = dict(model=model, case=case, documents=len(lens),
                             area=sum(n * (n + 1) for n in lens) / (seq * (seq + 1))), {}
            for mode in ("balanced", "simple"):
                balanced = mode == "balanced"
                schedule = functools.partial(documents.schedule, doc_lens=lens, balanced=balanced)
                layout = documents.cp_layout(a.cp, lens, balanced)
                qs, ks, vs, douts = ([parallel.cp_shard(x.transpose(1, 2), 1, r, a.cp, layout).transpose(1, 2)
                                      for r in range(a.cp)] for x in (q, k, v, dout))
                fwd_ms, bwd_ms, fwd = [], [], []
                for r in range(a.cp):
                    fwd_ms.append(1e3 * median_seconds(lambda: rank_forward(qs, ks, vs, r, schedule), device,
                                                       a.iters, a.warmup))
                    fwd.append(rank_forward(qs, ks, vs, r, schedule))
                    dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
                    dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
                    bwd_ms.append(1e3 * median_seconds(
                        lambda: rank_backward(douts, qs, ks, vs, fwd[r], r, dks, dvs, schedule), device, a.iters,
                        a.warmup))
                outs[mode] = parallel.cp_unshard([o for o, _ in fwd], 2, layout)
                total = [f + b for f, b in zip(fwd_ms, bwd_ms)]
                row[mode] = dict(rank_fwd_ms=fwd_ms, rank_bwd_ms=bwd_ms, rank_total_ms=total,
                                 imbalance=max(total) * len(total) / sum(total) - 1, chunks_per_rank=len(layout[0]),
                                 ring_steps=1 + schedule(0, a.cp, seq // a.cp).last,
                                 predicted_area=documents.document_area(lens, a.cp, balanced))
                del qs, ks, vs, douts, fwd
            row["balanced_vs_simple_rel"] = rel(outs["balanced"], outs["simple"])
            results.append(row)
            b, s = row["balanced"], row["simple"]
            print(f"{model:11} {case:13} area {row['area']:.4f} | balanced: ranks "
                  + " ".join(f"{t:7.1f}" for t in b["rank_total_ms"]) + f" ms, imbalance {b['imbalance']:5.1%}, "
                  f"{b['chunks_per_rank']} chunks/rank, {b['ring_steps']} ring steps | simple: ranks "
                  + " ".join(f"{t:7.1f}" for t in s["rank_total_ms"]) + f" ms, imbalance {s['imbalance']:5.1%} | "
                  f"outputs differ {row['balanced_vs_simple_rel']:.1e}", flush=True)
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                fa4=kernels.resolve_backend() == "fa4", seq_len=seq, cp=a.cp, iters=a.iters, attn=results)


def write_docs(path, lens, seed=0):
    """A .jsonl of text rows: with the byte tokenizer a row of n characters is one document of n training pairs."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for n in lens:
            fh.write(json.dumps({"text": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=n))}) + "\n")
    return path


def predicted(a, r):
    """plan.step_seconds for the levers the run chose and its windows' attn_area (mean over the timed steps)."""
    if r.get("levers") is None:
        return None
    mcfg = hf.read_config(os.path.join(ROOT, "bench", "configs", a.model))
    s = plan.Shape.of(mcfg, a.seq_len, a.nproc, a.nproc, a.nproc, attn_backend=kernels.resolve_backend())
    s = plan.replace(s, attn_area=statistics.mean(r["attn_area"]))
    return plan.step_seconds(s, plan.Levers(*r["levers"]))


def steps(a):
    os.makedirs(a.work, exist_ok=True)
    results = [run(a, "concat", ["--tokenizer", "byte", "--data", "synthetic", *a.extra.split()])]
    for case, lens in cases(a.seq_len).items():
        if len(lens) == 1:
            continue
        windows = lens * (a.steps + 1) if case != "mixed" else long_tailed(a.seq_len * (a.steps + 1), 0,
                                                                           median=a.seq_len // 64)
        path = write_docs(os.path.join(a.work, f"docs_{len(lens)}.jsonl"), windows)
        for mode in ("balanced", "simple"):
            r = run(a, f"{case}, {mode}", ["--tokenizer", "byte", "--data", path, "--packing", "docs",
                                           "--doc_attention", mode, *a.extra.split()])
            results.append({**r, "doc_attention": mode})
    for r in results:
        if "error" not in r:
            r["predicted_s"] = predicted(a, r)
            print(f"{r['name']:24} {r['s_per_step']:7.2f} s/step (predicted {r['predicted_s'] or float('nan'):6.2f})"
                  f", peak {r['peak_mem_gib']:.1f} GiB, attn_area {statistics.mean(r['attn_area']):.4f}", flush=True)
    return dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", model=a.model,
                seq_len=a.seq_len, nproc=a.nproc, backend=kernels.resolve_backend(), param_dtype="float32",
                runs=results)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["attn", "steps"])
    ap.add_argument("--small", action="store_true", help="attn: tiny fp32 shapes on CPU")
    ap.add_argument("--seq_len", type=int, default=0, help="default: attn 262144, steps 131072")
    ap.add_argument("--cp", type=int, default=2, help="attn: the ranks played")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=1, help="steps: GPUs (cp = nproc)")
    ap.add_argument("--model", default="qwen3-1.7b", help="steps: a folder under bench/configs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/doc_balance")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--extra", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    a.seq_len = a.seq_len or (262144 if a.part == "attn" else 131072)
    res = attn(a) if a.part == "attn" else steps(a)
    out = a.out or os.path.join(ROOT, "bench", "results", f"doc_balance_{a.part}" + ("_small" if a.small else "")
                                + ".json")
    json.dump(res, open(out, "w"), indent=1)
    print("wrote", out)
