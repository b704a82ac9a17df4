import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except (ImportError, OSError, RuntimeError):  # no torch, its libraries missing, or a driver that fails
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
