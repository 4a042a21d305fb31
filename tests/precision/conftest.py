"""Fixtures of the precision tests that train through the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def env():
    """The environment of a training subprocess: one thread, the shared corpus cache and DeepSpeed extensions."""
    e = dict(os.environ, OMP_NUM_THREADS="1", LLMJP_DS_CACHE=os.environ.get(
        "LLMJP_DS_CACHE", str(Path.home() / ".cache" / "llmjp-ds")))
    e.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "llmjp-ds" / "torch_extensions"))
    return e
