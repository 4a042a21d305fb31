"""A run of the parity check as the harness (benchmarks/parity/__main__.py) schedules it: its command, the runs it
starts after, the GPU memory it takes and how long it is expected to run; and the command that starts Megatron-LM's
``pretrain_gpt.py`` on one GPU."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    name: str
    cmd: list[str]
    after: tuple[str, ...] = ()
    gib: float = 46.0  # GPU memory at its peak (measured on the H200: BF16 ~45, FP8 ~47 GiB for the 1.8B at seq 4096)
    estimate_s: float = 90.0
    before: list[list[str]] = field(default_factory=list)  # commands run first (a run dir forked by hard links)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    state: str = "waiting"  # waiting | running | done | failed | skipped


def pretrain(mlm: Path, args: list[str]) -> list[str]:
    """``pretrain_gpt.py`` of the checkout ``mlm`` with ``args``, one process under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            str(mlm / "pretrain_gpt.py"), *args]
