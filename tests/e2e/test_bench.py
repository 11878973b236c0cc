"""The bench scripts' CPU modes, run as their docstrings give them: a script that has drifted from the code it
measures fails here, on any machine, instead of on the GPU machine. Each checks its JSON result exists; what the
numbers mean is each script's own business (and the GPU's). About 40 s on 2 CPU cores."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPTS = {  # name: (arguments, with {tmp} for the test's folder; the JSON file it writes)
    "bench_loss": (["--small", "--out", "{tmp}/out.json"], "out.json"),
    "ring_sim": (["--small", "--out", "{tmp}/out.json"], "out.json"),
    "fa4_attn": (["--small", "--out", "{tmp}/out.json"], "out.json"),
    "doc_balance": (["attn", "--small", "--out", "{tmp}/out.json"], "out.json"),
    "deltanet_layer": (["--small", "--out", "{tmp}/out.json"], "out.json"),
    "moe_rows": (["--small", "--out", "{tmp}/out.json"], "out.json"),
    "retrieval_cost": (["--config", "demo", "--out", "{tmp}/out.json", "--out_dir", "{tmp}/run"], "out.json"),
    "positions_cost": (["--model", "tiny", "--device", "cpu", "--seq_len", "512", "--work", "{tmp}/work", "--out",
                        "{tmp}/out.json"], "out.json"),
    "retrieval_small": (["--train_steps", "20", "--finetune_steps", "2", "--depths", "0.5", "--work", "{tmp}/work",
                         "--out", "{tmp}"], "retrieval_small.json"),
    "yarn_small": (["--train_steps", "10", "--finetune_steps", "2", "--work", "{tmp}/work", "--out", "{tmp}"],
                   "yarn_small.json"),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_cpu_mode_runs(name, tmp_path):
    args, result = SCRIPTS[name]
    cmd = [sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), *(a.format(tmp=tmp_path) for a in args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert json.load(open(tmp_path / result)), name


def test_the_readme_s_reading_counts_hold(tmp_path):
    """The README's "Reading order": each core file's line count and their sum exactly (wc -l), and the package
    lines a run calls within 10% of what bench/reading.py traces now (so that the README is rewritten when the
    path a reader follows grows or shrinks, not for every small edit)."""
    import re
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "reading.py"), "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.load(open(tmp_path / "r.json"))
    readme = open(os.path.join(ROOT, "README.md")).read()
    for name, n in r["core"].items():
        assert f"`{name}` ({n})" in readme, (name, n)
    assert f"5 files, {r['core_lines']:,} lines" in readme, r["core_lines"]
    said = re.search(r"hold ([\d,]+) lines in (\d+) modules, ([\d,]+) in all", readme.replace("\n", " "))
    package, modules, total = int(said[1].replace(",", "")), int(said[2]), int(said[3].replace(",", ""))
    assert abs(package - r["package_lines"]) <= 0.1 * r["package_lines"], (package, r["package"])
    assert modules == len(r["package"]) and total == r["core_lines"] + package, (modules, total, r)


def test_the_profile_summary_sorts_kernels_by_kind(tmp_path):
    """bench/profile_step.py's trace summary on a trace written here: the experts' grouped GEMMs apart from their
    routing (by the `moe` range a kernel was launched in), fla's kernels as deltanet (not torch's chunk_cat),
    the rest by name."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from profile_step import summarise_trace

    def kernel(name, ts, dur, corr):
        return [dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=1, args=dict(correlation=corr)),
                dict(ph="X", cat="kernel", name=name, ts=ts + 2, dur=dur, args=dict(correlation=corr))]
    events = [dict(ph="X", cat="user_annotation", name="moe", ts=100, dur=50)]
    launched = [("sm90_xmma_gemm_bf16_grouped", 110, 7), ("index_select_kernel", 120, 3),
                ("sm90_xmma_gemm_bf16", 200, 5), ("chunk_gated_delta_rule_fwd_kernel_h", 210, 4),
                ("flash_fwd_kernel", 220, 6), ("rms_norm_kernel", 230, 2), ("chunk_cat_cuda_kernel", 240, 1)]
    for i, (name, ts, dur) in enumerate(launched):
        events += kernel(name, ts, dur, i)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    got = {k: round(v * 1e6) for k, v in summarise_trace(str(path))["by_kind_s"].items()}
    assert got == {"experts GEMM": 7, "experts rest": 3, "matmul": 5, "deltanet": 4, "attention": 6, "other": 3}


def test_the_reserve_summary_splits_pools_by_stream():
    """bench/profile_step.py's reserve summary on a snapshot made here: each stream's pool reserved and free, the
    most alive at once on streams other than the compute stream (a free ends a tensor's life), and the largest
    allocation there by the line that made it."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from profile_step import summarise_reserve

    mib = 2**20
    snap = dict(allocator_settings=dict(expandable_segments=True), segments=[
        dict(stream=0, address=0, total_size=10 * mib, blocks=[dict(size=6 * mib, state="active_allocated"),
                                                               dict(size=4 * mib, state="inactive")]),
        dict(stream=7, address=0, total_size=5 * mib, blocks=[dict(size=5 * mib, state="inactive")])])
    reduce = [dict(filename="/x/_fsdp_collectives.py", line=59, name="allocate")]
    trace = [dict(action="alloc", stream=0, addr=1, size=6 * mib, frames=[]),
             dict(action="alloc", stream=7, addr=2, size=3 * mib, frames=reduce),
             dict(action="alloc", stream=7, addr=3, size=2 * mib, frames=reduce),
             dict(action="free_requested", stream=7, addr=2, size=3 * mib),
             dict(action="alloc", stream=7, addr=4, size=1 * mib, frames=reduce),
             dict(action="free_requested", stream=7, addr=3, size=2 * mib),
             dict(action="free_requested", stream=7, addr=4, size=1 * mib)]
    got = summarise_reserve(snap, trace)
    gib = mib / 2**30
    assert got["by_stream_gib"] == {"0": [10 * gib, 4 * gib], "7": [5 * gib, 5 * gib]}
    assert got["end_reserved_gib"] == 15 * gib and got["end_free_gib"] == 9 * gib
    assert got["side_streams_peak_gib"] == 5 * gib
    assert got["side_largest_gib"] == [("_fsdp_collectives.py:59 allocate", 3 * gib)]
