"""train.py --retrieval true end to end under FSDP2 and the ring: retrieval.jsonl's cells against transformers' scores
on the same windows. retrieval.py's oracles in-process: tests/test_retrieval.py.

    python -m pytest tests/e2e/test_retrieval.py -q
"""
import json
import os
import subprocess
import sys

import pytest

from million import retrieval as R
from test_retrieval import SOURCE, folders, hf_scores, windows  # noqa: F401 (folders: a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_py_scores_equal_transformers_under_fsdp_and_the_ring(folders, tmp_path):
    """--eval_only true --retrieval true at cp 2 (FSDP2 over both ranks): retrieval.jsonl's cells are those of
    transformers' scores on the same windows; one log line gives exact match by length."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), "--config", "demo", "--model", str(folders[True]), "--tokenizer", "byte",
           "--yarn_factor", "0", "--data", SOURCE, "--seq_len", "768", "--cp", "2", "--eval_only", "true",
           "--eval_sequences", "1", "--retrieval", "true", "--retrieval_lengths", "256,768",
           "--retrieval_depths", "0,0.5,1", "--retrieval_keys", "1", "--out_dir", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(tmp_path),
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    [row] = [json.loads(line) for line in open(out / "retrieval.jsonl")]
    ws = windows()
    want = R.cells(ws, hf_scores(folders[True], ws))
    assert row["windows"] == len(ws) and row["rope_scaling"]["factor"] == 4.0 and row["chat"] is False
    for got, ref in zip(row["cells"], want):
        assert {k: got[k] for k in ("length", "depth", "keys", "exact_match")} == \
            {k: ref[k] for k in ("length", "depth", "keys", "exact_match")}
        assert got["nll"] == pytest.approx(ref["nll"], abs=1e-5)
    lines = [x for x in p.stdout.splitlines() if x.startswith("retrieval    0 | exact match by length: 256: 0%")]
    assert len(lines) == 1, p.stdout
    assert (out / "retrieval.png").exists() or "no picture (matplotlib is not installed)" in p.stdout
