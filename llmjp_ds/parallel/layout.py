"""How the ranks of a run factor into parallel axes: ``world = pipeline x data x tensor``, and an MoE model's
experts split over groups of ``expert`` data-parallel ranks. Pure arithmetic.

Every quantity that depends on the factorisation (data-parallel size, gradient accumulation) is computed here;
the process groups of the axes are :mod:`llmjp_ds.parallel.context`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Layout:
    world: int
    pipeline: int = 1
    tensor: int = 1
    expert: int = 1  # the expert-parallel size: a subgroup of the data-parallel ranks

    @classmethod
    def of(cls, cfg, world: int | None = None) -> "Layout":
        return cls(world=world or world_size_from_env(), pipeline=cfg.parallel.pipeline_stages,
                   tensor=cfg.parallel.tensor_parallel, expert=cfg.parallel.expert_parallel)

    @property
    def data(self) -> int:
        return self.world // (self.pipeline * self.tensor)

    def fits(self) -> bool:
        return self.world % (self.pipeline * self.tensor) == 0

    def gradient_accumulation_steps(self, global_batch: int, micro_batch: int) -> int:
        return global_batch // (micro_batch * self.data)

    @property
    def name(self) -> str:
        """``TP4 x PP16 x DP8`` (``PP2 x DP1`` without tensor parallelism; ``PP1 x DP4 (EP2)`` with the experts
        split over pairs of data-parallel ranks)."""
        tensor = f"TP{self.tensor} x " if self.tensor > 1 else ""
        expert = f" (EP{self.expert})" if self.expert > 1 else ""
        return f"{tensor}PP{self.pipeline} x DP{self.data}{expert}"

    def describe(self, zero_stage: int) -> str:
        return f"{self.name}, ZeRO-{zero_stage}"
