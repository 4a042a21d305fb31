"""Choosing the layer backend: Transformer Engine on a CUDA GPU, else the pure-PyTorch twin."""

from __future__ import annotations

import os
from types import ModuleType

from llmjp_ds.errors import fail

BACKENDS = ("auto", "te", "torch")


def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or TE's own "needs CUDA" RuntimeError
        return False
    return True


def resolve_backend(name: str | None = None) -> str:
    """``auto`` (default, or ``$LLMJP_DS_BACKEND``) picks ``te`` when TE imports and CUDA is present."""
    import torch

    name = name or os.environ.get("LLMJP_DS_BACKEND", "auto")
    if name not in BACKENDS:
        fail(f"unknown model backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "te" if torch.cuda.is_available() and te_importable() else "torch"
    if name == "te" and not (torch.cuda.is_available() and te_importable()):
        fail("backend 'te' needs Transformer Engine and a CUDA GPU: `pip install 'llmjp-ds[te]'` on a GPU "
             "machine, or use backend 'torch'")
    return name


def layers_module(name: str) -> ModuleType:
    if name == "te":
        from llmjp_ds.model import te_layers

        return te_layers
    from llmjp_ds.model import torch_layers

    return torch_layers
