"""Fixtures shared by every test tier."""
import pathlib

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """The default tiny Qwen2-layout model, built once per test session."""
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
