"""Which samples each rank reads: a pure function of the global sample counter.

Step ``s`` consumes the global samples ``[consumed, consumed + global_batch)``. Micro-batch ``m`` of
data-parallel rank ``r`` holds ``micro`` consecutive samples starting at ``consumed + (m * dp + r) * micro``.
The union over ranks and micro-batches is the same set for any (dp, micro, accumulation) layout with the same
global batch, so runs on different numbers of processes see the same data, and resuming from a
consumed-samples count continues exactly. It is Megatron-LM's ``MegatronPretrainingSampler``
(megatron/training/datasets/data_samplers.py): rank ``r``'s ``m``-th micro-batch from ``consumed`` is
``[consumed + (m * dp + r) * micro, ... + micro)``.

A validation reads global batches of the validation split (:func:`validation_starts`).
"""

from __future__ import annotations

import numpy as np
import torch


def micro_batch_indices(consumed: int, micro_index: int, micro_size: int, dp_rank: int, dp_size: int) -> range:
    start = consumed + (micro_index * dp_size + dp_rank) * micro_size
    return range(start, start + micro_size)


def micro_batch(dataset, indices, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)`` of shape ``[micro, seq]`` from samples of ``seq + 1`` tokens."""
    tokens = torch.from_numpy(np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices]))
    if device is not None:
        tokens = tokens.to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def step_micro_batches(dataset, consumed: int, gas: int, micro_size: int, dp_rank: int, dp_size: int, device=None):
    return [micro_batch(dataset, micro_batch_indices(consumed, m, micro_size, dp_rank, dp_size), device)
            for m in range(gas)]


def validation_starts(order: str, step: int, eval_interval: int, eval_batches: int, global_batch: int) -> list[int]:
    """The first global sample of each global batch a validation after ``step`` steps reads.

    ``llmjp``: the first global batch, every time. ``megatron``: Megatron-LM's evaluation never restarts its
    validation iterator (and a resume starts it at ``iteration // eval_interval * eval_iters * gbs``), so the
    ``k``-th evaluation (``k = 0`` after ``eval_interval`` steps) reads the next ``eval_batches`` global batches:
    samples ``[k * eval_batches * gbs, (k + 1) * eval_batches * gbs)``. A validation between two evaluations
    (``recipe: auto``'s at a flip) reads the batches of the last one (the first evaluation's before any).
    """
    if order != "megatron":
        return [0]
    batches = max(1, eval_batches)
    k = max(step // eval_interval, 1) - 1 if eval_interval else 0
    return [(k * batches + b) * global_batch for b in range(batches)]



# --- steps whose samples are read and not trained on (train.skip_steps, a rollback's window) -------------------

def skip_window(checkpoint_step: int, spike_step: int, before: int | None, after: int) -> list[int]:
    """The steps ``[first, last]`` a rollback to the checkpoint after step ``checkpoint_step`` skips for a spike at
    step ``spike_step``: from the checkpoint's next step (``before`` None) or ``before`` steps ahead of the spike,
    through it and ``after`` steps more."""
    first = checkpoint_step + 1 if before is None else max(checkpoint_step + 1, spike_step - before)
    return [first, spike_step + after]


def skipped(step: int, ranges) -> bool:
    """Whether step ``step`` lies in one of the ``[first, last]`` ranges."""
    return any(first <= step <= last for first, last in ranges)
