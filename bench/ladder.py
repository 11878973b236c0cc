"""The memory ladder: peak GPU memory against sequence length with each lever added in turn, and the longest
sequence one GPU trains. Runs train.py (through bench/train_steps.py) once per point; a point that runs out of
memory is recorded as such. Writes JSON and a PNG plot.

    python bench/ladder.py                                    # Qwen3-1.7B, 32k..128k, 5 rungs (GPU, ~8 min)
    python bench/ladder.py --model qwen3-4b --rungs 0 --longest 262144 --extra "--keep_attention false"
    python bench/ladder.py --small                            # tiny model on CPU: exercises the script only

Rungs (each adds one lever to the one before; block checkpointing is on in all of them, as in the reference):
plain (the loss over all rows at once, i.e. full logits) -> chunked loss -> offload to host -> tiled MLP ->
keep attention (no attention recompute). One step per point: train.py allocates the AdamW states before the
first step, so its peak is the run's. --longest L1,L2,...: those lengths with every lever on (+ --extra).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_steps import ROOT, run_one  # noqa: E402

RUNGS = [
    ("plain", "--loss_chunk 100000000 --offload false --tiled_mlp false --keep_attention false"),
    ("+ chunked loss", "--offload false --tiled_mlp false --keep_attention false"),
    ("+ offload", "--offload true --tiled_mlp false --keep_attention false"),
    ("+ tiled MLP", "--offload true --tiled_mlp true --keep_attention false"),
    ("+ keep attention", "--offload true --tiled_mlp true --keep_attention true"),
]


def point(model, seq, extra, args, results, rung):
    r = run_one(model, seq, args.steps, extra + " " + args.extra, "/tmp/ladder_runs", args.timeout)
    if "error" in r:
        r["oom"] = "out of memory" in r["error"].lower()
    r["rung"] = rung
    results.append(r)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:  # after every point: a run cut short keeps what it measured
        json.dump(results, fh, indent=2)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--rungs", type=int, default=len(RUNGS), help="how many rungs of the ladder to run")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--longest", default="", help="comma-separated lengths to try with every lever on")
    ap.add_argument("--small", action="store_true", help="tiny model on CPU, to check the script")
    ap.add_argument("--extra", default="")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "ladder.json"))
    args = ap.parse_args()
    if args.small:
        args.model, args.seqs, args.extra = "tiny", "256,512", args.extra + " --device cpu --dtype float32"
        args.longest = args.longest or "1024"
    seqs = [int(s) for s in args.seqs.split(",")]
    results = []
    for name, extra in RUNGS[:args.rungs]:
        for seq in seqs:
            if point(args.model, seq, extra, args, results, name).get("error"):
                break  # longer sequences of this rung will not fit either
    for seq in [int(s) for s in args.longest.split(",") if s]:
        point(args.model, seq, RUNGS[-1][1], args, results, "longest")
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"\n{'rung':<18}{'tokens':>9}{'peak GiB':>10}{'s, step 1':>11}  (step 1 includes warm-up)")
    for r in results:
        cell = "OOM" if r.get("oom") else ("failed" if r.get("error") else f"{r['peak_mem_gib']:.1f}")
        print(f"{r['rung']:<18}{r['seq_len']:>9}{cell:>10}{r.get('s_per_step', float('nan')):>11.2f}")
    fits = [r["seq_len"] for r in results if r["rung"] in ("longest", RUNGS[-1][0]) and "error" not in r]
    if fits:
        print(f"longest sequence trained with every lever on: {max(fits):,} tokens")
    plot(results, args.model, os.path.splitext(args.out)[0] + ".png")


def plot(results, model, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, _ in RUNGS:
        pts = [(r["seq_len"], r["peak_mem_gib"]) for r in results if r["rung"] == name and "error" not in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(f"{model}: peak memory per lever (one GPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
