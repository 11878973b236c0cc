"""The README's "Your own data" commands, run exactly as written, each in a copy of the repository: every one
trains (metrics.jsonl has finite losses over trained tokens), and the viewer shows trained tokens in [[ ]].
About a minute on 2 CPU cores."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from test_readme import COMMANDS, ROOT


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    """The tracked files a user has after cloning (the .py files, examples/, tests/fixtures/), in a fresh folder."""
    dst = tmp_path_factory.mktemp("clone")
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), dst / name)
    shutil.copytree(os.path.join(ROOT, "examples"), dst / "examples")
    shutil.copytree(os.path.join(ROOT, "million"), dst / "million", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.mark.parametrize("command", COMMANDS, ids=[c.split("--data ")[-1].split()[0] for c in COMMANDS])
def test_readme_command_runs_as_written(repo_copy, command):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}  # torchrun and python of this interpreter
    p = subprocess.run(command, shell=True, cwd=repo_copy, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, (command, p.stdout[-2000:], p.stderr[-3000:])
    if command.startswith("python -m million.chat"):
        assert "[[" in p.stdout and "]]" in p.stdout
        return
    out_dir = command.split("--out_dir ")[1].split()[0]
    rows = [json.loads(line) for line in open(repo_copy / out_dir / "metrics.jsonl")]
    assert rows and all(math.isfinite(r["loss"]) and r["num_tokens"] > 0 for r in rows), rows
    assert "the data ran out after step" in p.stdout + p.stderr
