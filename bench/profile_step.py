"""Where one training step's time and memory go: runs train.py with --profile_step, then summarises the
torch.profiler trace (GPU time per kind of kernel, idle time, the largest kernels) and the CUDA allocator's
history (what is alive at the step's peak, grouped by the line of our code that allocated it).

    python bench/profile_step.py --run qwen3-4b:131072                   # step 2 timed, step 3 profiled
    python bench/profile_step.py --run qwen3-1.7b:131072 --extra "--keep_attention false"
    python bench/profile_step.py --dir runs/x/profile                   # summarise an existing profile

Kinds of kernel, by name: attention (cuDNN/flash SDPA), matmul (cuBLAS/CUTLASS GEMMs), optimizer (fused AdamW),
copy (host<->device and device copies), loss (any kernel launched inside the `chunked_nll` range, matmuls
included), experts GEMM and experts rest (kernels launched inside a MoE block's `moe` range: the grouped GEMMs, and
the router, permutation and elementwise work), deltanet (fla's rule, conv and l2norm kernels), other (elementwise,
norms, reductions). Writes summary.json next to the trace.
"""
import argparse
import collections
import gzip
import json
import os
import pickle
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_steps import run_one  # noqa: E402

MATMUL = r"gemm|nvjet|cutlass|xmma|cublas|sm90_.*tn|splitk"
KINDS = [("attention", r"sdpa|fmha|flash|attention|cudnn"), ("optimizer", r"adam|multi_tensor"),
         ("deltanet", r"chunk_(?!cat)|delta|conv1d|solve_tril|recompute_w_u|l2norm"), ("matmul", MATMUL)]
RANGES = {"chunked_nll": "loss", "moe": "experts"}  # record_function names in model.py, moe.py -> kind of kernels
OUR_FILES = ("model.py", "moe.py", "lora.py", "loss.py", "parallel.py", "kernels.py", "documents.py", "optim.py",
             "train.py", "qwen3_5.py", "deltanet.py")


def union_us(intervals):
    total, end = 0.0, -1e30
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarise_trace(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    # kernels launched inside a named range: match each kernel to its launch (same correlation id) on the CPU
    ranges = [(RANGES[e["name"]], e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("ph") == "X" and e.get("name") in RANGES and e.get("cat") == "user_annotation"]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events  # runtime and driver API launches (Triton, cuBLAS)
                 if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and "correlation" in e.get("args", {})}
    by_kind, by_name = collections.Counter(), collections.Counter()
    for k in kernels:
        name = k["name"]
        t = launch_ts.get(k.get("args", {}).get("correlation"))
        if k["cat"] != "kernel":
            kind = "copy"
        else:
            kind = next((kd for kd, s, e in ranges if t is not None and s <= t <= e), None) or next(
                (kd for kd, pat in KINDS if re.search(pat, name, re.I)), "other")
            if kind == "experts":  # the experts' GEMMs apart from the routing, permutation and elementwise work
                kind = "experts GEMM" if re.search(MATMUL, name, re.I) else "experts rest"
        by_kind[kind] += k["dur"]
        by_name[(kind, name[:90])] += k["dur"]
    compute = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if k["cat"] == "kernel"]
    if not compute:
        raise SystemExit(f"{path}: no GPU kernels in this trace (a CPU run?); open it in chrome://tracing instead")
    span = max(e for _, e in compute) - min(s for s, _ in compute)
    busy = union_us(compute)
    return dict(span_s=span / 1e6, compute_busy_s=busy / 1e6, idle_s=(span - busy) / 1e6,
                by_kind_s={k: v / 1e6 for k, v in by_kind.most_common()},
                top_kernels=[(kind, n, v / 1e6) for (kind, n), v in by_name.most_common(15)])


def where(frames):
    """The innermost frame in our own files, else the innermost Python frame."""
    for f in frames:
        if os.path.basename(f["filename"]) in OUR_FILES:
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    py = [f for f in frames if f["filename"].endswith(".py")]
    return f"{os.path.basename(py[0]['filename'])}:{py[0]['line']} {py[0]['name']}" if py else "?"


def summarise_memory(path):
    """Replay the allocator's events: find the step's peak, then what is alive there, by allocating line.

    Two counts: "allocated" drops when a tensor is freed (as torch.cuda.max_memory_allocated counts); "held"
    drops only when the memory can be reused, which for a tensor used on another stream (record_stream) is
    later, once that stream's work is done. Held memory is what the allocator must reserve."""
    snap = pickle.load(open(path, "rb"))
    trace = snap["device_traces"][0]
    traced = {e["addr"] for e in trace if e["action"] == "alloc"}
    # alive before recording began: untraced blocks still alive at the end + untraced blocks freed in the step
    before = 0
    for seg in snap["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b.get("address", addr) not in traced:
                before += b["size"]
            addr += b["size"]
    before += sum(e["size"] for e in trace if e["action"] == "free_completed" and e["addr"] not in traced)
    gib, out = 2**30, dict(before_step_gib=before / 2**30)
    for kind, freed in (("allocated", "free_requested"), ("held", "free_completed")):
        total, peak, peak_i = 0, 0, -1
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                total += e["size"]
            elif e["action"] == freed:
                total -= e["size"]
            if total > peak:
                peak, peak_i = total, i
        live = {}
        for e in trace[:peak_i + 1]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
            elif e["action"] == freed:
                live.pop(e["addr"], None)
        groups = collections.Counter()
        for e in live.values():
            groups[where(e.get("frames", []))] += e["size"]
        # where the step was when the peak came: the peak allocation's frames in our files, innermost first
        ours = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in trace[peak_i].get("frames", [])
                if os.path.basename(f["filename"]) in OUR_FILES] if peak_i >= 0 else []
        out[kind] = dict(peak_in_step_gib=peak / gib, peak_total_gib=(before + peak) / gib, peak_during=ours[:8],
                         at_peak_gib=[(w, b / gib) for w, b in groups.most_common(16)])
    out["reserved"] = summarise_reserve(snap, trace)
    return out


def summarise_reserve(snap, trace):
    """The allocator's reserve (what it holds from the driver: whole segments, or pages mapped into expandable
    ones). At the snapshot (the step's end): how much is free, in how many blocks, the largest. Over the step:
    each time it grew (the reserve only grows within a step), largest first, with the allocation it grew for."""
    grew = sorted((e for e in trace if e["action"] in ("segment_alloc", "segment_map")), key=lambda e: -e["size"])
    free = sorted((b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "inactive"),
                  reverse=True)
    gib = 2**30
    streams = collections.defaultdict(lambda: [0, 0])  # each CUDA stream has a pool of its own: [reserved, free]
    for seg in snap["segments"]:
        pool = streams[seg.get("stream", 0)]
        pool[0] += seg["total_size"]
        pool[1] += sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
    side, alive, side_peak = collections.Counter(), 0, 0  # what the step allocates on streams other than the default
    for e in trace:
        if e.get("stream", 0) and e["action"] in ("alloc", "free_requested"):
            alive += e["size"] if e["action"] == "alloc" else -e["size"]
            side_peak = max(side_peak, alive)
            if e["action"] == "alloc":
                w = where(e.get("frames", []))
                side[w] = max(side[w], e["size"])
    return dict(expandable_segments=snap.get("allocator_settings", {}).get("expandable_segments"),
                side_streams_peak_gib=side_peak / gib, side_largest_gib=[(w, b / gib) for w, b in side.most_common(8)],
                by_stream_gib={str(k): [v[0] / gib, v[1] / gib] for k, v in streams.items()},
                end_reserved_gib=sum(r for r, _ in streams.values()) / gib,
                end_free_gib=sum(free) / gib, end_free_blocks=len(free),
                end_largest_free_gib=[b / gib for b in free[:8]],
                grew_gib=sum(e["size"] for e in grew) / gib, times_grown=len(grew),
                largest_growths=[(e["size"] / gib, where(e.get("frames", []))) for e in grew[:12]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="qwen3-4b:131072", help="model:seq_len (a folder under bench/configs)")
    ap.add_argument("--dir", default="", help="summarise this existing profile folder instead of running")
    ap.add_argument("--extra", default="")
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    d = a.dir
    if not d:
        model, seq = a.run.split(":")
        r = run_one(model, int(seq), 3, a.extra + " --profile_step 3", "/tmp/profile_runs", a.timeout)
        if "error" in r:
            raise SystemExit(r["error"])
        d = os.path.join(r["out_dir"], "profile")
        rows = [json.loads(line) for line in open(os.path.join(r["out_dir"], "metrics.jsonl"))]
        print(f"step 2 (not profiled): {rows[1]['step_time_s']:.2f} s, "
              f"peak {rows[1]['peak_mem_gib']:.2f} GiB")
    out = dict(trace=summarise_trace(os.path.join(d, "trace_rank0.json")))
    mem = os.path.join(d, "memory_rank0.pickle")
    if os.path.exists(mem):
        out["memory"] = summarise_memory(mem)
    t = out["trace"]
    print(f"\nGPU span {t['span_s']:.2f} s: kernels busy {t['compute_busy_s']:.2f} s, idle {t['idle_s']:.2f} s")
    for k, v in t["by_kind_s"].items():
        print(f"  {k:<14}{v:8.2f} s  {v / t['span_s']:6.1%}")
    print("largest kernels:")
    for kind, name, v in t["top_kernels"]:
        print(f"  {v:8.3f} s  {kind:<9} {name}")
    for kind, m in out.get("memory", {}).items():
        if kind == "reserved":
            print(f"\nreserve (expandable segments: {m['expandable_segments']}): grown {m['times_grown']} times in the "
                  f"step, by {m['grew_gib']:.2f} GiB; at the end {m['end_reserved_gib']:.2f} GiB, "
                  f"{m['end_free_gib']:.2f} GiB of it free in {m['end_free_blocks']} blocks, the largest "
                  + ", ".join(f"{b:.2f}" for b in m["end_largest_free_gib"]) + " GiB. By stream (reserved, free): "
                  + ", ".join(f"{s}: {r:.2f}, {f:.2f}" for s, (r, f) in m["by_stream_gib"].items())
                  + " GiB. Largest growths:")
            for g, w in m["largest_growths"]:
                print(f"  {g:8.3f} GiB  {w}")
            print(f"allocated on other streams in the step: at most {m['side_streams_peak_gib']:.2f} GiB alive; "
                  "the largest, by where:")
            for w, g in m["side_largest_gib"]:
                print(f"  {g:8.3f} GiB  {w}")
            continue
        if kind == "before_step_gib":
            continue
        print(f"\nmemory {kind}: {out['memory']['before_step_gib']:.2f} GiB alive before the step (weights, "
              f"AdamW states) + {m['peak_in_step_gib']:.2f} GiB at the step's peak = {m['peak_total_gib']:.2f} GiB:")
        for w, g in m["at_peak_gib"]:
            print(f"  {g:8.3f} GiB  {w}")
    with open(os.path.join(d, "summary.json"), "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
