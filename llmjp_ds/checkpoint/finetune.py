"""A fine-tune start (``model.init_from_checkpoint``, Megatron-LM's ``--finetune``): a new run whose first step
starts from the weights of another run's checkpoint, with a new optimizer, a new LR schedule and its data from the
first sample, as Megatron-LM loads a checkpoint under ``--finetune`` (the model's weights, iteration and consumed
samples reset, no optimizer state). Only a run's first start reads the source; once the run saved its own
checkpoint, a resume reads that.

The source is checked before any process group exists (:func:`check_finetune`): a run directory (its ``latest``) or
one checkpoint directory of it, verified against its manifest, saved from a model of the run's shape.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmjp_ds.checkpoint.readers import read_model_state
from llmjp_ds.checkpoint.resume_checks import shape_differences, verify_tag
from llmjp_ds.checkpoint.store import MARKER, CheckpointMeta, checkpoint_dir, latest_tag, read_marker, vet_tag
from llmjp_ds.errors import fail

KEY = "model.init_from_checkpoint"


def finetune_source(path) -> tuple[Path, str]:
    """(run directory, tag) that ``path`` names: a checkpoint directory (``RUN/checkpoints/stepNNNNNNNN``) or a run
    directory, whose ``latest`` it means."""
    path = Path(path)
    if (path / MARKER).is_file() and path.parent.name == "checkpoints":
        return path.parent.parent, path.name
    if not checkpoint_dir(path).is_dir():
        fail(f"{KEY}={path} is neither a run directory (with checkpoints/) nor one of its checkpoints: pass a run "
             "directory, or RUN/checkpoints/stepNNNNNNNN")
    tag = latest_tag(path)
    if tag is None:
        fail(f"{KEY}={path} has no complete checkpoint: pass one of its checkpoints (RUN/checkpoints/stepNNNNNNNN)")
    return path, tag


def check_finetune(path, model_config: dict) -> tuple[Path, str, CheckpointMeta]:
    """The source of a fine-tune start, checked: intact (its manifest) and saved from a model of the shape of
    ``model_config`` (the run's, as a dict)."""
    run_dir, tag = finetune_source(path)
    marker = read_marker(run_dir, tag)
    damaged = verify_tag(vet_tag(run_dir, tag), marker) if marker.files is not None else None
    if damaged:
        fail(f"{KEY}: checkpoint {tag} of {run_dir} fails its manifest ({damaged}): start from another of its "
             "checkpoints")
    diff = shape_differences(marker.model_config, model_config)
    if diff:
        fail(f"{KEY}: checkpoint {tag} of {run_dir} was saved from another model shape ({', '.join(diff)}): give the "
             "run that model's settings, or start from a checkpoint of this shape")
    return run_dir, tag, marker


def finetune_weights(run_dir, tag: str, marker: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The whole model's weights of the source (our names, on CPU, FP8 scaling state left out): the module's
    weights as saved, in the dtype the run trained them in, as Megatron's ``--finetune`` loads them."""
    return {k: v for k, v in read_model_state(run_dir, tag, marker).items() if not k.endswith("_extra_state")}
