import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; elsewhere (CI) they are skipped, not failed. On the GPU machine:
    `pytest -m gpu tests`."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
