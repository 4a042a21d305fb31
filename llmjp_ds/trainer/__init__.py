"""The training loop's room: the :class:`Trainer` that sets a run up and steps it (``trainer.py``), and its jobs,
a file each: validation (``evaluation.py``), saves (``saving.py``), resume and rollback (``resuming.py``),
stopping early (``stopping.py``)."""

from llmjp_ds.trainer.stopping import StopRequest
from llmjp_ds.trainer.trainer import Trainer, TrainState, data_plan, run_data

__all__ = ["StopRequest", "Trainer", "TrainState", "data_plan", "run_data"]
