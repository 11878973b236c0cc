"""Fit plan.py's cost-model constants to the runs in bench/results/, and check them out of sample.

    python bench/fit_plan.py --fit     # the constants that fit FIT_FILES best (for plan.FITTED), each run's error
    python bench/fit_plan.py --check   # each run by constants fitted without it; then CHECK_FILES, never fitted

The fit is relative least squares, time and memory apart: step time is linear in 1/attention rate (one per
backend), 1/GEMM rate, the per-token-per-layer term, the stochastic-rounding step's per-parameter term and (MoE
runs) the per-routed-pair term;
peak memory in the two per-token working sets.
"""
import argparse
import json
import os
import sys
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from million import plan  # noqa: E402
from million import hf  # noqa: E402

FIT_FILES = ("train_steps_v6.json", "train_steps_fp32_v6.json", "longest_4b.json", "x2_c2ce9fc.json",
             "train_steps_fa4_v7.json", "train_steps_4b_fa4_v7.json", "plan_check.json", "plan_check_moe.json")
CHECK_FILES = ("plan_check_4b_fp32.json", "plan_check_8b_524k.json",  # never fitted: see check()
               "plan_check_8b_1gpu_sr.json", "plan_check_moe_check.json", "doc_balance_steps_1gpu.json")
# Runs measured while a recomputed block still held its output through its own backward (freed first since
# 2026-12-07: model._RecomputedBlock): that [T, hidden] tensor is taken off their peaks, as bench/memory_ab.sh
# measured it (bench/NOTES.md, "The three memory fixes, measured"). Named one by one: a file measured since does
# not belong here
HELD_OUTPUT = ("train_steps_v6.json", "train_steps_fp32_v6.json", "longest_4b.json", "x2_c2ce9fc.json",
               "train_steps_fa4_v7.json", "train_steps_4b_fa4_v7.json", "plan_check.json", "plan_check_moe.json",
               "plan_check_4b_fp32.json", "plan_check_8b_524k.json", "plan_check_8b_1gpu_sr.json",
               "plan_check_moe_check.json", "doc_balance_steps_1gpu.json")


def held_output_gib(s: plan.Shape) -> float:
    """What a run measured before 2026-12-07 held at its peak beyond what the code holds now: the recomputed
    block's output, [tokens, hidden] in the activations' dtype (HELD_OUTPUT)."""
    return s.tokens * s.hidden * s.act_bytes / 2**30


def measured_runs(files, root=os.path.join(ROOT, "bench")):
    """[(Shape, Levers, s/step, peak GiB, name)] of the runs in bench/results/<files>. A run names its levers
    (offload_layers, keep_attention_layers, or levers: [both]); older files without them offloaded every block and
    kept attention unless their flags said otherwise (each of these fallbacks is still needed by a file above).
    A file that is a dict gives its runs its model, seq_len, backend, param_dtype and nproc (= cp) unless a run
    has its own;
    a run of packed documents gives its attn_area (bench/doc_balance.py: one per timed step)."""
    runs = []
    for f in files:
        path = os.path.join(root, "results", f)
        if not os.path.exists(path):
            continue
        data = json.load(open(path))
        common = {k: data[k] for k in ("model", "seq_len", "backend", "param_dtype")
                  if isinstance(data, dict) and k in data}
        if isinstance(data, dict) and "nproc" in data:
            common.update(cp=data["nproc"], world=data["nproc"])
        for r in data["runs"] if isinstance(data, dict) else data:
            if "error" in r or r.get("doc_attention") == "simple":  # the model times the balanced path only
                continue
            r = {**common, **dict(zip(("offload_layers", "keep_attention_layers"), r.get("levers") or ())), **r}
            mcfg = hf.read_config(os.path.join(root, "configs", r["model"]))
            extra = r.get("extra", "")
            fp32 = "float32" in extra or r.get("param_dtype") == "float32"
            backend = r.get("backend") or ("fa4" if "--attn_backend fa4" in extra else "cudnn")
            cp = r.get("cp", 1)
            s = plan.Shape.of(mcfg, r["seq_len"], cp, r.get("world", cp), 1, param_bytes=4 if fp32 else 2,
                              attn_backend=backend, stochastic_rounding="stochastic_rounding true" in extra)
            area = r.get("attn_area", 1.0)
            s = replace(s, attn_area=sum(area) / len(area) if isinstance(area, list) else area)
            lv = plan.Levers(r.get("offload_layers", s.layers),
                             r.get("keep_attention_layers", 0 if "keep_attention false" in extra else s.layers))
            name = (f"{r['model']} {r['seq_len']} cp{cp}{' dp' + str(s.world // cp) if s.world > cp else ''} "
                    f"{'fp32' if fp32 else 'bf16'} {backend} off {lv.offload_layers} keep {lv.keep_attention_layers}"
                    + (f" {r['name']}" if "name" in r else ""))
            held = held_output_gib(s) if f in HELD_OUTPUT else 0.0
            runs.append((s, lv, r["s_per_step"], r["peak_mem_gib"] - held, name))
    return runs


def solve(runs, k: plan.Constants = plan.FITTED) -> plan.Constants:
    """The constants that fit `runs` best; a backend no run used keeps its rate from k."""
    backends = sorted({s.attn_backend for s, *_ in runs})
    A, B, z = [], [], []
    for s, lv, t, mem, _ in runs:
        attn = plan.attention_flops(s, lv) / 1e12
        A.append(np.array([attn * (b == s.attn_backend) for b in backends]
                          + [plan.gemm_flops(s) / 1e12, s.layers * s.tokens / 1e6, plan.sr_gparams(s),
                             plan.routed_slots(s) / 1e6]) / t)
        # gpu_bytes is linear in the two working sets: what it counts without them is known
        per_constant = np.array([s.tokens * s.hidden, s.tokens * s.heads * s.head_dim * (s.cp > 1)])
        known = plan.gpu_bytes(s, lv, replace(k, work_bytes_per_token_hidden=0, ring_bytes_per_token_qdim=0))
        B.append(per_constant / (mem * 2**30))
        z.append(1 - known / (mem * 2**30))
    moe = any(plan.routed_slots(s) for s, *_ in runs)
    A = np.array(A)[:, :None if moe else -1]  # no MoE run: the routing term keeps its value from k
    x = np.linalg.lstsq(A, np.ones(len(A)), rcond=None)[0]
    w = np.linalg.lstsq(np.array(B), np.array(z), rcond=None)[0]
    n = len(backends)
    return replace(k,  # LoRA's and NF4's terms are not fitted here: bench/lora_linear.py and a QLoRA run measure them
        attn_tflops={**k.attn_tflops, **{b: round(1 / float(x[i]), 1) for i, b in enumerate(backends)}},
        gemm_tflops=round(1 / float(x[n]), 1), other_s_per_mtoken_layer=round(float(x[n + 1]), 3),
        sr_s_per_gparam=round(float(x[n + 2]), 3),
        work_bytes_per_token_hidden=round(float(w[0]), 1), ring_bytes_per_token_qdim=round(float(w[1]), 2),
        moe_s_per_mslot_layer=round(float(x[n + 3]), 3) if moe else k.moe_s_per_mslot_layer)


def errors(runs, k: plan.Constants = plan.FITTED):
    """[(run, relative time error, relative GPU memory error)] under the constants k."""
    out = []
    for s, lv, t, mem, name in runs:
        c = plan.predict(s, lv, k)
        out.append((name, c.step_s / t - 1, c.gpu_gib / mem - 1))
    return out


def fit():
    """Fit the constants to FIT_FILES; print them (copy them into plan.FITTED to keep them) and return each run's
    error."""
    runs = measured_runs(FIT_FILES)
    fitted = solve(runs)
    for name, value in vars(fitted).items():
        print(f"{name} = {value}")
    return errors(runs, fitted)


def check():
    """Errors out of sample: each run of FIT_FILES predicted by the constants fitted to all the others (leave one
    out), then the runs of CHECK_FILES, which no fit has seen, by plan.FITTED."""
    runs = measured_runs(FIT_FILES)
    out = [errors([run], solve(runs[:i] + runs[i + 1:]))[0] for i, run in enumerate(runs)]
    return out + [(name + " *", dt, dm) for name, dt, dm in errors(measured_runs(CHECK_FILES))]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true", help="re-fit the constants to FIT_FILES, print the errors")
    ap.add_argument("--check", action="store_true", help="out-of-sample errors: leave-one-out and CHECK_FILES")
    a = ap.parse_args()
    if not (a.fit or a.check):
        ap.error("say --fit or --check")
    if a.check:
        print("each run predicted by constants fitted without it; * = a run outside the fit")
    for name, dt, dm in fit() if a.fit else check():
        print(f"{name:<52} time {dt:+6.1%}   GPU memory {dm:+6.1%}")
