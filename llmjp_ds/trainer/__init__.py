"""The training loop's room: the :class:`Trainer` that sets a run up and steps it (``trainer.py``), and its jobs,
a file each: the model under DeepSpeed and one optimizer step of it (``step.py``, which ``llmjp-ds bench`` drives
too), validation (``evaluation.py``), saves (``saving.py``), resume and rollback (``resuming.py``), stopping early
(``stopping.py``)."""

from llmjp_ds.trainer.step import StepEngine, precision_schedule
from llmjp_ds.trainer.stopping import StopRequest
from llmjp_ds.trainer.trainer import Trainer, TrainState, data_plan, run_data

__all__ = ["StepEngine", "StopRequest", "Trainer", "TrainState", "data_plan", "precision_schedule", "run_data"]
