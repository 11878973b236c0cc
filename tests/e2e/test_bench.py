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
