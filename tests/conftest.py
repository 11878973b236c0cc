import os

import pytest
import torch


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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; elsewhere (CI) they are skipped, not failed. On the GPU machine:
    `pytest -m gpu tests`."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
