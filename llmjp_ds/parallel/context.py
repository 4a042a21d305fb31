"""The process groups of a run: starting torch.distributed, and one object the rest asks for ranks and groups.

A :class:`ParallelContext` is made once per process, after the config is validated. Before the engine exists
it knows the world (rank, device, :class:`~llmjp_ds.parallel.layout.Layout`); :meth:`ParallelContext.bind`
then takes the data-parallel group from the engine's pipeline grid (DeepSpeed builds the pipe x data topology
inside ``PipelineModule``), or the world without a pipeline. No process group lives in a module global.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from llmjp_ds.parallel.layout import Layout


def init_distributed() -> None:
    """Start torch.distributed through DeepSpeed (NCCL on CUDA, gloo on CPU); a lone process gets defaults."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ:
        # a lone process (python -m llmjp_ds.train, llmjp-ds demo): its rendezvous port is private, so take a free
        # one rather than 29500, which another job on a shared machine may hold (EADDRINUSE at startup)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                         ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, default)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


@dataclass
class ParallelContext:
    layout: Layout
    rank: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object | None = None  # None: the world (no pipeline)

    @classmethod
    def start(cls, layout: Layout) -> "ParallelContext":
        import torch.distributed as dist

        init_distributed()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return cls(layout=layout, rank=dist.get_rank(), device=device, dp_rank=dist.get_rank(),
                   dp_size=dist.get_world_size())

    def bind(self, engine) -> None:
        """Take the data-parallel rank, size and group from a pipeline engine's grid (a ZeRO engine's data
        parallelism is the world)."""
        grid = getattr(engine, "grid", None)
        if grid is not None:
            self.dp_rank = grid.get_data_parallel_rank()
            self.dp_size = grid.get_data_parallel_world_size()
            self.dp_group = grid.get_data_parallel_group()

    @property
    def amax_reduction_group(self):
        """TE's FP8 amax reduction group: the stage's data-parallel group under a pipeline (the world would
        hang, as stages hold different modules), else the world (None)."""
        return self.dp_group if self.layout.pipeline > 1 else None

    # --- collectives the trainer uses ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.all_reduce(t)
        return bool(t.item() > 0)
