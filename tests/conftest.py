import os
from pathlib import Path

import pytest
import torch

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_ignore_collect(collection_path, config):
    """`pytest tests` is the unit tier: tests/e2e (train.py, torchrun and the scripts run as subprocesses) is
    collected only when it, or a file or test in it, is named: `pytest tests/e2e`."""
    if collection_path.resolve() != E2E:
        return None
    named = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    return None if any(p == E2E or E2E in p.parents for p in named) else True


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """On a machine without a GPU, `pytest tests` runs two test files at a time (pytest-xdist, one file per
    worker so that a file's fixtures run once; up to four with more cores): most tests launch train.py under
    torchrun and spend their time starting processes and waiting on them, which leaves a second core idle.
    An explicit -n (-n 0: one at a time) or -p no:xdist is kept; GPU runs stay serial (one GPU)."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.getoption("numprocesses", None) is not None or torch.cuda.is_available()
            or config.getoption("collectonly") or (os.cpu_count() or 1) < 2):
        return
    config.option.numprocesses = min(4, os.cpu_count())
    config.option.dist = "loadfile"
    # one worker's share of the cores for each worker's torch (the workers inherit this); torch's default of every
    # core for every worker left the workers' threads waiting on each other: the unit tier took 2.4 times the CPU
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() // config.option.numprocesses)))


# The files that take longest (about 4.5, 4, 3.5 and 2.5 minutes on 2 cores), started first so that two workers
# end together instead of one running the last long file alone
LONGEST_FIRST = ("test_train.py", "test_long_runs.py", "test_survival.py", "test_checkpoint.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; elsewhere (CI) they are skipped, not failed. On the GPU machine:
    `pytest -m gpu tests`. The longest files go first (the order within each file is kept)."""
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
