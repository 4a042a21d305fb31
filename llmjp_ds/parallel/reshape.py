"""Resuming a checkpoint on another layout: another data-parallel size, pipeline depth, tensor-parallel size or
expert-parallel size, with ZeRO-1.

DeepSpeed's ZeRO-1 checkpoint is cut by the layout that wrote it: one optimizer file per (data, model-parallel)
rank, each holding a flat slice of every parameter group, pipeline weights named by layer index, and under TP each
rank's shard of the split weights. A relaunch on another layout converts it once into a layout-free form beside it,
``<tag>/layout-free/``: one file per parameter under our names (``hf_adapter``) with its whole fp32 master weights
and Adam moments (TP shards merged: the moments split as the weights do), plus the modules' ``_extra_state`` (FP8
amax histories and scales; a TP slice shares them) and the optimizer step. Each rank of the new layout then reads
the files of its own parameters, its TP shard of each, into its engine. An MoE model's experts are files of their
own under their global index, wherever they lived: each rank reads the experts it holds now. The experts' FP8 state
(one per grouped GEMM, of as many GEMMs as a rank holds experts) carries over only between layouts without expert
parallelism. The global batch is the run's, so the
gradient accumulation follows the new data-parallel size and the samples of every step stay the same.

The DeepSpeed checkpoint format and optimizer internals this needs live in ``parallel/deepspeed_internals.py``.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from llmjp_ds.errors import fail
from llmjp_ds.io_utils import write_bytes_atomic
from llmjp_ds.model.hf_adapter import ep_global_name, pipeline_module_name_to_ours, tp_merge, tp_shard
from llmjp_ds.parallel.deepspeed_internals import (seed_optimizer_state, zero_checkpoint_params, zero_checkpoint_ranks,
                                                   zero_checkpoint_step)
from llmjp_ds.parallel.layout import Layout

CONVERTED = "layout-free"
DONE = "complete"


def saved_layout(tag_dir) -> tuple[int, int]:
    """(pipeline stages, data-parallel size) that wrote a checkpoint of an earlier release (no TP), from its
    optimizer files' names."""
    ranks = zero_checkpoint_ranks(tag_dir)
    if not ranks:
        fail(f"{tag_dir} has no ZeRO optimizer files: it cannot be resumed on another layout (ZeRO-1 only)")
    return max(pp for _, pp in ranks) + 1, max(dp for dp, _ in ranks) + 1


def _ours(name: str, pipeline: bool, num_layers: int) -> str:
    return pipeline_module_name_to_ours(name, num_layers) if pipeline else name


def convert(tag_dir, num_layers: int, read_extra_states, saved: Layout, load, num_experts: int = 0) -> Path:
    """Write ``<tag>/layout-free/`` from the checkpoint in ``tag_dir`` (once: a finished conversion is kept),
    written on the layout ``saved``; ``read_extra_states()`` returns its modules' ``_extra_state`` entries under
    our names; ``load(path)`` reads a checkpoint file (the safe reader); ``num_experts``: an MoE model's."""
    tag_dir = Path(tag_dir)
    out = tag_dir / CONVERTED
    if (out / DONE).is_file():
        return out
    stages, data, tensor = saved.pipeline, saved.data, saved.tensor
    pipeline = stages > 1
    for name, shards in zero_checkpoint_params(tag_dir, stages, data, tensor, load, saved.expert, num_experts):
        ours = _ours(name, pipeline, num_layers)
        _save(out / f"{ours}.pt", {key: tp_merge(ours, [s[key] for s in shards]) for key in shards[0]})
    _save(out / "_extra_state.pt", {"step": zero_checkpoint_step(tag_dir, load), "extra": read_extra_states()})
    write_bytes_atomic(out / DONE, f"{stages} {data} {tensor} {saved.expert}\n".encode())
    return out


def _save(path: Path, obj) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def load_converted(engine, converted: Path, num_layers: int, load, tp=None, ep=None, num_experts: int = 0) -> None:
    """Set this rank's engine (weights, fp32 master weights, Adam moments and step, FP8 state) from a
    conversion, its files read with ``load(path)``; ``tp``: this rank's tensor-parallel slice, whose shard of
    each parameter it takes; ``ep``: its expert-parallel group, whose experts (of ``num_experts``) it takes."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state


    pipeline = hasattr(engine, "grid") and engine.is_pipe_parallel
    meta = load(converted / "_extra_state.pt")
    seed_optimizer_state(engine.optimizer, meta["step"])
    module = engine.module
    for name, param in module.named_parameters():
        ours = _ours(name, pipeline, num_layers)
        if ep is not None:
            ours = ep_global_name(ours, ep.rank, ep.local(num_experts))
        full = load(converted / f"{ours}.pt")
        if tp is not None:
            full = {key: tp_shard(ours, value, tp.rank, tp.size).contiguous() for key, value in full.items()}
        with torch.no_grad():
            param.copy_(full["fp32"].to(param.device, param.dtype))
        safe_set_full_fp32_param(param, full["fp32"].to(param.device))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(param, full[key].to(param.device), key)
    extra = {name: meta["extra"][_ours(name, pipeline, num_layers)] for name in module.state_dict()
             if name.endswith("_extra_state") and _ours(name, pipeline, num_layers) in meta["extra"]}
    module.load_state_dict(extra, strict=False)
