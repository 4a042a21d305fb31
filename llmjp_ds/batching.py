"""Which samples each rank reads: a pure function of the global sample counter.

Step ``s`` consumes the global samples ``[consumed, consumed + global_batch)``. Micro-batch ``m`` of
data-parallel rank ``r`` holds ``micro`` consecutive samples starting at ``consumed + (m * dp + r) * micro``.
The union over ranks and micro-batches is the same set for any (dp, micro, accumulation) layout with the same
global batch, so runs on different numbers of processes see the same data, and resuming from a
consumed-samples count continues exactly.
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
