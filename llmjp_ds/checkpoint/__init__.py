"""Checkpoints of a run: where they live, who owns the run directory, how they are written, read and resumed.

* :mod:`.store`: tags, the manifest marker, ``latest``, pruning and the kept log-spaced saves;
* :mod:`.manifest`: the per-file digests a checkpoint is verified by;
* :mod:`.lock`: the one owner of a run directory;
* :mod:`.async_save`: saving in the background while training goes on;
* :mod:`.safe_load`: reading checkpoint files without running code from them;
* :mod:`.readers`: a checkpoint's model weights and client state, on any layout;
* :mod:`.client_state`: the run's state saved beside the weights, its keys in one place;
* :mod:`.resume_checks`: choosing the intact checkpoint to resume, and checking that the run's past agrees;
* :mod:`.branch`: a new run from another run's checkpoint, with its own schedule;
* :mod:`.finetune`: a new run from another run's weights alone (a fine-tune start, Megatron's ``--finetune``).

The names below are what the trainer, the demo and the CLI use. Checkpoints of other systems (Hugging Face,
Megatron-LM) come and go through :mod:`llmjp_ds.interchange`.
"""

from llmjp_ds.checkpoint.async_save import AsyncSaver, commit_when_done
from llmjp_ds.checkpoint.finetune import check_finetune, finetune_weights
from llmjp_ds.checkpoint.lock import RunDirLock
from llmjp_ds.checkpoint.readers import load, read_client_state, read_model_state, trusted_te_extra_state
from llmjp_ds.checkpoint.resume_checks import check_resume, choose_intact, resumed_schedule
from llmjp_ds.checkpoint.safe_load import load_checkpoint_file
from llmjp_ds.checkpoint.store import (LATEST, MARKER, CheckpointMeta, checkpoint_dir, complete_tags, discard_after,
                                       latest_tag, prune, prune_incomplete, read_marker, remove_tag, save,
                                       saved_layout, tag_for)

__all__ = ["LATEST", "MARKER", "AsyncSaver", "CheckpointMeta", "RunDirLock", "check_finetune", "check_resume",
           "checkpoint_dir", "choose_intact", "commit_when_done", "complete_tags", "discard_after", "finetune_weights",
           "latest_tag", "load", "load_checkpoint_file", "prune", "prune_incomplete", "read_client_state",
           "read_marker", "read_model_state", "remove_tag", "resumed_schedule", "save", "saved_layout", "tag_for",
           "trusted_te_extra_state"]
