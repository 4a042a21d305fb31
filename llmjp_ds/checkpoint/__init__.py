"""Checkpoints of a run: the store (tags, manifest, ``latest``, prune; ``store.py``), the one owner of a run
directory (``lock.py``), reading them safely (``safe_load.py``, ``readers.py``) and Hugging Face export / import
(``hf.py``). The names below are what the trainer, the demo and the CLI use."""

from llmjp_ds.checkpoint.async_save import AsyncSaver, commit_when_done
from llmjp_ds.checkpoint.hf import cli_main, export, import_hf
from llmjp_ds.checkpoint.lock import RunDirLock
from llmjp_ds.checkpoint.readers import load, read_client_state, read_model_state, trusted_te_extra_state
from llmjp_ds.checkpoint.safe_load import load_checkpoint_file
from llmjp_ds.checkpoint.resume import check_resume, choose_intact, resumed_schedule
from llmjp_ds.checkpoint.store import (LATEST, MARKER, CheckpointMeta, checkpoint_dir, complete_tags, discard_after,
                                       latest_tag, prune, prune_incomplete, read_marker, remove_tag, save,
                                       saved_layout, tag_for)

__all__ = ["LATEST", "MARKER", "AsyncSaver", "CheckpointMeta", "commit_when_done", "RunDirLock", "check_resume", "checkpoint_dir", "choose_intact",
           "cli_main", "complete_tags", "discard_after", "export", "import_hf", "latest_tag", "load",
           "load_checkpoint_file", "prune", "prune_incomplete", "read_client_state", "read_marker", "read_model_state", "remove_tag", "resumed_schedule",
           "save", "saved_layout", "tag_for", "trusted_te_extra_state"]
