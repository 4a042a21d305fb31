"""Reading checkpoints: into DeepSpeed's engine (resume, rollback), and without it (export, reshape).

Every file goes through one reader, :func:`llmjp_ds.checkpoint.safe_load.load_checkpoint_file`
(``weights_only=True``, an allowlist, TE's pickled extra state vetted), DeepSpeed's own reads included: the engine
is handed that reader before it loads. A tag is read only if it lies inside the run's ``checkpoints/`` and none
of its files is a symbolic link (:func:`~llmjp_ds.checkpoint.store.vet_tag`).
"""

from __future__ import annotations

import contextlib
import os

import torch

from llmjp_ds.checkpoint.client_state import KEYS
from llmjp_ds.checkpoint.manifest import save_hashed
from llmjp_ds.checkpoint.safe_load import load_checkpoint_file, vet_files
from llmjp_ds.checkpoint.store import CheckpointMeta, checkpoint_dir, vet_tag
from llmjp_ds.errors import fail
from llmjp_ds.model.hf_adapter import pipeline_module_name_to_ours, pipeline_name_to_ours, tp_merge_state_dicts
from llmjp_ds.parallel.deepspeed_internals import (EXPERT_STATES_GLOB, MODEL_STATES_GLOB, PIPELINE_LAYER_GLOB,
                                                   from_expert_file_key, model_states_file, pipeline_layer_ranks,
                                                   route_checkpoint_io)
from llmjp_ds.parallel.reshape import CONVERTED

CLIENT_STATE = "client_state.pt"  # the trainer's state of a checkpoint that has no DeepSpeed files (an import)


@contextlib.contextmanager
def trusted_te_extra_state():
    """TE >= 2.18 refuses pickled extra state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. Our reader has
    vetted every ``_extra_state`` pickle before TE sees it (safe_load.vet_extra_state), so TE may unpickle
    while a checkpoint loads through it; never otherwise."""
    key = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def load(engine, run_dir, tag: str) -> dict:
    """Load checkpoint ``tag`` into ``engine`` (weights, optimizer, FP8 state); returns the trainer's state."""
    vet_tag(run_dir, tag)
    route_checkpoint_io(engine, load_checkpoint_file, save_hashed)
    with trusted_te_extra_state():
        path, client_state = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag,
                                                    load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None:
        fail(f"DeepSpeed could not load checkpoint {tag!r} from {checkpoint_dir(run_dir)}")
    return client_state or {}


def read_client_state(run_dir, tag: str) -> dict:
    """The trainer's own state saved with checkpoint ``tag`` (train state, precision, guard, wandb id), read
    without an engine (a resume on another layout; an imported checkpoint keeps it in a file of its own)."""
    d = vet_tag(run_dir, tag)
    state = load_checkpoint_file(d / CLIENT_STATE if (d / CLIENT_STATE).is_file() else d / model_states_file(0))
    return {k: state[k] for k in KEYS if k in state}


def read_model_state(run_dir, tag: str, marker: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The model's full state dict (our names) from a ZeRO-0..3, pipeline or expert-parallel checkpoint, on CPU.
    Every file is read with weights_only=True, and one that names code is refused before anything of it is
    unpickled. An expert-parallel checkpoint's experts come from their own files (one per expert, DeepSpeed's MoE
    layout), their FP8 state left out (one per rank)."""
    d = vet_tag(run_dir, tag)
    if marker.layout_free:  # an imported checkpoint: the fp32 master weights of the layout-free form
        return {f.name[:-3]: load_checkpoint_file(f)["fp32"] for f in sorted((d / CONVERTED).glob("*.pt"))
                if f.name != "_extra_state.pt"}
    if marker.expert_parallel > 1:
        return _expert_parallel_state(d, marker.pipeline_stages, marker.model_config["num_hidden_layers"])
    if marker.pipeline_stages > 1:
        n = marker.model_config["num_hidden_layers"]
        shards: list[dict] = [{} for _ in range(marker.tensor_parallel)]
        for f in sorted(d.glob(PIPELINE_LAYER_GLOB)):
            idx, tp_rank = pipeline_layer_ranks(f.name)
            for name, tensor in load_checkpoint_file(f).items():
                shards[tp_rank][pipeline_name_to_ours(idx, n, name)] = tensor
        return tp_merge_state_dicts(shards)
    if marker.zero_stage == 3:
        # DeepSpeed's reader unpickles with weights_only=False: it sees the tag's files only once all are vetted
        vet_files(d)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(open(os.devnull, "w")):
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    files = sorted(d.glob(MODEL_STATES_GLOB))
    if len(files) < marker.tensor_parallel or not files:
        fail(f"{d} has {len(files)} model states files for tensor_parallel={marker.tensor_parallel}: the checkpoint "
             "is incomplete")
    return tp_merge_state_dicts([load_checkpoint_file(f)["module"] for f in files[:marker.tensor_parallel]])


def _expert_parallel_state(d, stages: int, num_layers: int) -> dict[str, torch.Tensor]:
    """The model of an expert-parallel checkpoint in directory ``d``: the dense weights of its model states (one
    file per pipeline stage, its layers under the pipeline module's names), the experts' weights of their own files
    under our names and global indices."""
    state = {}
    for stage in range(stages):
        state.update(load_checkpoint_file(d / model_states_file(stage))["module"])
    experts = sorted(d.glob(EXPERT_STATES_GLOB))
    if not experts:
        fail(f"{d} holds no expert files ({EXPERT_STATES_GLOB}) for its expert_parallel > 1: the checkpoint is "
             "incomplete")
    for f in experts:
        state.update({from_expert_file_key(k): v for k, v in load_checkpoint_file(f).items()
                      if not k.endswith("_extra_state")})
    if stages == 1:
        return state
    return {pipeline_module_name_to_ours(k, num_layers): v for k, v in state.items()}
