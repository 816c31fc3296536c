"""The `cuda` tier: smoke tests of the trainer's accelerator paths on one NVIDIA GPU (scripts/device_check.sh runs them).

Every test here is marked `cuda` and skipped, with the reason naming the missing hardware, where torch sees no GPU.
"""
import pathlib
import sys

import pytest
import torch

UNIT_TESTS = str(pathlib.Path(__file__).resolve().parents[1] / "unit")
if UNIT_TESTS not in sys.path:
    sys.path.insert(0, UNIT_TESTS)  # trainer_helpers: the tiny model with informative weights, random batches


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if here in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
