"""Fixtures of the precision tests that train through the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.launch import subprocess_env


@pytest.fixture(scope="module")
def env():
    """The environment of a training subprocess (:func:`tests.launch.subprocess_env`) with the shared corpus cache
    and DeepSpeed extensions."""
    home = Path.home() / ".cache" / "llmjp-ds"
    return subprocess_env(LLMJP_DS_CACHE=os.environ.get("LLMJP_DS_CACHE", str(home)),
                          TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(home / "torch_extensions")))
