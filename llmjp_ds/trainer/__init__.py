"""The training loop's room: the :class:`Trainer` that sets a run up and steps it, and its jobs, a module each.

* :mod:`.trainer`: the Trainer, built whole, and its loop, which asks the precision controller and the health
  monitor at fixed points and acts on their answers;
* :mod:`.step`: the model under DeepSpeed and one optimizer step of it (what ``llmjp-ds bench`` drives too);
* :mod:`.heldout_loss`: validation, the mean loss over fixed held-out batches;
* :mod:`.saving`: saves in the background and their commit;
* :mod:`.restore`: back to a checkpoint: the newest intact one at the start, the one before a spike or a
  divergence in a rollback;
* :mod:`.stopping`: a stop signal, or this rank's launcher gone, ending the run at a step boundary;
* :mod:`.ending`: a run that ends early with one line (a stop verdict, the rollback limit, non-finite steps in a
  row, a record that cannot be written), a ``stop`` event first.
"""

from llmjp_ds.trainer.step import StepEngine, precision_schedule
from llmjp_ds.trainer.stopping import StopRequest
from llmjp_ds.trainer.trainer import Trainer, TrainState, data_plan, run_data

__all__ = ["StepEngine", "StopRequest", "Trainer", "TrainState", "data_plan", "precision_schedule", "run_data"]
