"""What a checkpoint carries of the trainer besides DeepSpeed's own state (DeepSpeed's ``client_state``, in rank 0's
model-states file; an imported checkpoint keeps it in a file of its own): its keys, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class ClientState:
    train_state: dict = field(default_factory=dict)  # the loop's progress (trainer.TrainState)
    precision: dict = field(default_factory=dict)  # the precision schedule's switches (precision.schedule)
    guard: dict = field(default_factory=dict)  # FP8's divergence guard (precision.guards)
    penalty: dict = field(default_factory=dict)  # FP8's penalty monitor
    # the health monitor's histories, recent rollbacks and starved experts (health/monitor.py)
    health: dict = field(default_factory=dict)
    wandb_run_id: str | None = None  # the wandb run a resume continues
    rng: Any = None  # torch's CPU generator state
    imported_from: dict | None = None  # import-megatron: the Megatron checkpoint the run continues

    @classmethod
    def from_dict(cls, data: dict | None) -> "ClientState":
        """The known keys of a loaded client state (none: a fresh run)."""
        data = data or {}
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data and data[f.name] is not None})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


KEYS = tuple(f.name for f in fields(ClientState))
