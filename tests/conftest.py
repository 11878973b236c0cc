import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
E2E = HERE / "e2e"


def pytest_ignore_collect(collection_path, config):
    """`pytest tests` is the unit tier: tests/e2e (train.py, torchrun and the scripts run as subprocesses) is
    collected only when it, or a file or test in it, is named: `pytest tests/e2e`."""
    if collection_path.resolve() != E2E:
        return None
    named = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    return None if any(p == E2E or E2E in p.parents for p in named) else True


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """On a machine without a GPU, pytest runs test files two at a time (pytest-xdist, one file per worker so that
    a file's fixtures run once: a module's gloo worlds, the end-to-end tier's reference runs; up to four with more
    cores). The unit tier computes on both cores; the end-to-end tier's tests launch train.py under torchrun and
    spend much of their time starting processes and waiting on them. An explicit -n (-n 0: one at a time) or
    -p no:xdist is kept; GPU runs stay serial (one GPU)."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.getoption("numprocesses", None) is not None or torch.cuda.is_available()
            or config.getoption("collectonly") or (os.cpu_count() or 1) < 2):
        return
    config.option.numprocesses = min(4, os.cpu_count())
    config.option.dist = "loadfile"
    # one worker's share of the cores for each worker's torch (the workers inherit this); torch's default of every
    # core for every worker left the workers' threads waiting on each other: the unit tier took 2.4 times the CPU
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() // config.option.numprocesses)))


# The files that take longest in each tier, started first so that two workers end together instead of one running
# the last long file alone. Measured on 2 cores (shared with other work, so the seconds are high): the unit tier's
# about 25, 19, 10, 9 and 8 s of its ~85 s of tests; the end-to-end tier's about 6, 6, 4, 3 and 2.5 minutes of ~25
LONGEST_FIRST = ("test_docs.py", "test_moe.py", "test_qwen3_5.py", "test_retrieval.py", "test_lora.py",
                 "e2e/test_train.py", "e2e/test_long_runs.py", "e2e/test_survival.py", "e2e/test_checkpoint.py",
                 "e2e/test_optim.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; elsewhere (CI) they are skipped, not failed. On the GPU machine:
    `pytest -m gpu tests` (and `pytest -m gpu tests/e2e` for train.py over NCCL). The longest files go first (the
    order within each file is kept)."""
    def rank(item):
        name = item.path.relative_to(HERE).as_posix() if HERE in item.path.parents else item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
