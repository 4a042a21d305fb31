"""Fixtures shared by the whole suite: small model configs, the path to the shared LLM-jp assets, and the
trainer's CPU runs that ``tests/train/`` and ``tests/parallel/`` share (``tests/runs.py``, once per session).
Subprocesses are started through one launcher, ``tests/launch.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.cluster import gridengine, gridengine_cluster, hosts, net_hosts, slurm, slurm_cluster  # noqa: F401
from tests.runs import exports, flip_runs, runs, train_env  # noqa: F401  (session fixtures of two suites)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LLMJP_DS_SHARED", REPO.parent / "shared"))

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def shared_path(*parts: str) -> Path:
    """A file under ../shared, or skip the test (a user's fresh clone has no ../shared)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (../shared is only beside the developers' checkout)")
    return path


# Three shapes the HF-parity tests run on: GQA, MHA, and odd sizes (vocab not a multiple of 128).
PARITY_SHAPES = {
    "gqa": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=176,
                vocab_size=512, seq_len=64),
    "mha": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=128,
                vocab_size=384, seq_len=64),
    "odd": dict(hidden_size=72, num_layers=3, num_attention_heads=6, num_key_value_heads=1, ffn_hidden_size=100,
                vocab_size=1001, seq_len=48, rope_theta=500000.0, rms_norm_eps=1e-6),
}


@pytest.fixture(params=sorted(PARITY_SHAPES))
def parity_config(request):
    from llmjp_ds.model import model_config

    return model_config("tiny", **PARITY_SHAPES[request.param])
