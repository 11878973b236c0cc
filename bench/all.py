"""The whole benchmark in one command: the chunked loss against full logits, attention (the ring's kernels
against one cuDNN call), training steps against the reference recipe, and the memory ladder; then one table
from the JSON files they write.

    python bench/all.py                 # GPU: ~20 minutes on one H200 (the parts' times added) -> bench/results/
    python bench/all.py --small         # CPU: tiny shapes through every script and the table (~1 minute)
    python bench/all.py --summary       # only the table, from the JSON files already in --dir

Each part is its own script (bench/bench_loss.py, ring_sim.py, train_steps.py, ladder.py), run here in a
subprocess so that each measures its own peak memory; their docstrings say what and how they measure.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The reference recipe's single-GPU step on the same GPU kind (s/step, peak GiB): transformers Qwen3 + SDPA, bf16,
# per-layer checkpoints offloaded with save_on_cpu, its chunked loss, fused AdamW.
REFERENCE = {("qwen3-1.7b", 32768): (2.30, 17.3), ("qwen3-1.7b", 65536): (6.58, 21.7),
             ("qwen3-1.7b", 131072): (21.5, 30.7), ("qwen3-4b", 131072): (52.9, 56.7)}


def run(d, small):
    steps = ["--runs", "tiny:512,tiny:1024", "--extra", "--device cpu --dtype float32"] if small else []
    for script, args in (("bench_loss.py", ["--small"] if small else []),
                         ("ring_sim.py", ["--small"] if small else []),
                         ("train_steps.py", steps),
                         ("ladder.py", ["--small"] if small else [])):
        name = {"bench_loss.py": "loss", "ring_sim.py": "ring_sim"}.get(script, script[:-3])
        cmd = [sys.executable, os.path.join(HERE, script), *args, "--out", os.path.join(d, name + ".json")]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)


def load(d, name):
    path = os.path.join(d, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None


def num(x, spec):
    if x is None:  # not measured on this device (the CPU has no peak-memory counter)
        return "-".rjust(int(spec.split(".")[0] or 0))
    return format(x, spec)


def summary(d):
    print(f"\n==== summary of {d}")
    loss = load(d, "loss")
    if loss:
        print(f"\nchunked loss, {loss['shape']['rows']:,} x {loss['shape']['vocab']:,} x {loss['shape']['hidden']:,}, "
              f"{loss['device']} (3-GEMM floor {num(loss['gemm_floor_ms'], '.1f')} ms)")
        for r in loss["rows"]:
            print(f"  {r['method']:<14}{r['ms_median']:8.1f} ms{num(r['peak_extra_gib'], '8.2f')} GiB extra"
                  f"   dW err {r['grad_weight_rel_err']:.1e}")
    ring = load(d, "ring_sim")
    if ring:
        print(f"\nattention, ring of {ring['cp']} simulated vs one {ring['kernel']} call, {ring['seq_len']:,} tokens, "
              f"{ring['q_heads']}/{ring['kv_heads']} heads, {ring['device']}")
        for k, t in ring["timing"].items():
            print(f"  {k:<8} ring {t['ring_ms']:8.1f} ms ({t['ring_tflops']:5.0f} TFLOP/s)   one call "
                  f"{t['single_ms']:8.1f} ms ({t['single_tflops']:5.0f} TFLOP/s)   efficiency {t['efficiency']:.1%}")
    steps = load(d, "train_steps")
    if steps:
        print(f"\ntraining steps (one GPU, all levers){'':<6}{'s/step':>8}{'tok/s':>9}{'MFU':>7}{'peak GiB':>10}"
              f"{'host GiB':>10}{'ref s':>8}{'ref GiB':>9}")
        for r in steps:
            if "error" in r:
                print(f"  {r['model']:<12}{r['seq_len']:>9}  failed: {r['error'][-120:]}")
                continue
            ref = REFERENCE.get((r["model"], r["seq_len"]))
            ref = f"{ref[0]:8.2f}{ref[1]:9.1f}" if ref else f"{'-':>8}{'-':>9}"  # the reference was not measured
            print(f"  {r['model']:<12}{r['seq_len']:>9}{'':<21}{r['s_per_step']:8.2f}{r['tokens_per_s']:9,.0f}"
                  f"{r['mfu']:7.1%}{r['peak_mem_gib']:10.1f}{r['host_offload_gib']:10.1f}{ref}")
    trl = [r for r in (load(d, f"reference_trl_{m}_262k") for m in ("1.7b", "8b")) if r]
    if trl:  # bench/reference_trl.py and train.py on the same two GPUs
        print(f"\ntwo GPUs, 262,144 tokens, cp 2, fp32 state{'':<20}{'s/step':>8}{'peak GiB':>10}")
        for r in trl:
            print(f"  TRL recipe    {os.path.basename(r['model']):<12}{'':<27}{r['s_per_step']:8.2f}"
                  f"{r['peak_mem_gib']:10.1f}")
        for r in (load(d, "plan_check") or []) + (load(d, "x2_c2ce9fc") or []):
            if r["seq_len"] == 262144 and r.get("cp") == 2:
                how = r.get("backend", "cudnn") + (f", {r['offload_layers']} blocks offloaded"
                                                   if "offload_layers" in r else ", all offloaded")
                print(f"  train.py      {r['model']:<12}{how:<27}{r['s_per_step']:8.2f}{r['peak_mem_gib']:10.1f}")
    ladder = load(d, "ladder")
    if ladder:
        seqs = sorted({r["seq_len"] for r in ladder})
        print("\nmemory ladder, peak GiB" + "".join(f"{s:>10,}" for s in seqs))
        for rung in dict.fromkeys(r["rung"] for r in ladder):
            cells = {r["seq_len"]: ("failed" if r.get("error") else f"{r['peak_mem_gib']:.1f}")
                     for r in ladder if r["rung"] == rung}
            print(f"  {rung:<21}" + "".join(f"{cells.get(s, '-'):>10}" for s in seqs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny shapes on CPU: checks every script and the table")
    ap.add_argument("--summary", action="store_true", help="only print the table from --dir")
    ap.add_argument("--dir", default="", help="where the JSON files go (default bench/results; /tmp/bench_small)")
    a = ap.parse_args()
    d = a.dir or ("/tmp/bench_small" if a.small else os.path.join(HERE, "results"))
    os.makedirs(d, exist_ok=True)
    if not a.summary:
        run(d, a.small)
    summary(d)


if __name__ == "__main__":
    main()
