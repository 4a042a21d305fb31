"""Reading a torch.distributed.checkpoint directory (Megatron-Core's ``torch_dist`` format) without DCP's loader.

DCP's own reader unpickles ``.metadata`` with ``pickle.load`` and every byte item with ``torch.load(weights_only=
False)``: either would run whatever a planted file names. Here ``.metadata`` goes through
:func:`~llmjp_ds.checkpoint.safe_load.load_dcp_metadata` and every item (a tensor chunk or the bytes of a
Megatron ``ShardedObject``) through :func:`~llmjp_ds.checkpoint.safe_load.load_megatron`; a tensor is assembled
whole from its chunks (each a ``torch.save`` of a tensor at an offset of a ``__R_K.distcp`` file).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from llmjp_ds.checkpoint.safe_load import load_dcp_metadata, load_megatron
from llmjp_ds.errors import fail


class DistCheckpoint:
    """One ``torch_dist`` directory: its tensors by key (whole) and its objects by key."""

    def __init__(self, directory):
        self.dir = Path(directory)
        if not (self.dir / ".metadata").is_file():
            fail(f"{self.dir} lacks .metadata (written last by torch.distributed.checkpoint): the checkpoint is "
                 "incomplete, or its save did not finish; copy it again from the Megatron run")
        metadata = load_dcp_metadata(self.dir / ".metadata")
        try:
            self.entries = dict(metadata.state_dict_metadata)
            self.storage = {(i.fqn, tuple(i.offset) if i.offset is not None else None): s
                            for i, s in metadata.storage_data.items()}
        except (AttributeError, TypeError) as exc:
            fail(f"{self.dir / '.metadata'} is not the metadata of a distributed checkpoint ({exc}): the checkpoint "
                 "is damaged; copy it again from the Megatron run")
        files = sorted({s.relative_path for s in self.storage.values()})
        missing = [f for f in files if not (self.dir / f).is_file()]
        if missing:
            fail(f"{self.dir} lacks {missing[0]}" + (f" and {len(missing) - 1} more shard files" if len(missing) > 1
                                                   else "") + ", which its .metadata lists: the checkpoint is "
                 "incomplete; copy every __*.distcp file of it")

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.entries.items() if hasattr(v, "chunks")]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key].size)

    def has(self, key: str) -> bool:
        return key in self.entries

    def _read(self, info) -> bytes:
        path = self.dir / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            fail(f"{path} is cut short: the metadata places an item at bytes {info.offset}..{info.offset + info.length}"
                 f" of it, but it has {path.stat().st_size} bytes; copy it again from the Megatron run")
        return data

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, assembled from its chunks."""
        entry = self.entries.get(key)
        if entry is None or not hasattr(entry, "chunks"):
            fail(f"{self.dir} holds no tensor {key!r}: the checkpoint is incomplete or of another model")
        shape, dtype = tuple(entry.size), entry.properties.dtype
        out, covered = None, 0
        for chunk in entry.chunks:
            info = self.storage.get((key, tuple(chunk.offsets)))
            if info is None:
                fail(f"{self.dir / '.metadata'} lists a chunk of {key!r} it does not store: the checkpoint is damaged")
            part = load_megatron(self._read(info), where=str(self.dir / info.relative_path))
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                fail(f"{self.dir / info.relative_path} holds a wrong chunk of {key!r} (shape "
                     f"{list(getattr(part, 'shape', []))}, the metadata says {list(chunk.sizes)}): it is damaged")
            if tuple(part.shape) == shape and part.dtype == dtype:  # whole in one chunk: no second copy of it
                return part
            if out is None:
                out = torch.empty(shape, dtype=dtype)
            region = out
            for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, start, size)
            region.copy_(part)
            covered += part.numel()
        if out is None or covered < out.numel():
            fail(f"{self.dir} stores only {covered} of the {math.prod(shape)} elements of {key!r}: the checkpoint is "
                 "incomplete")
        return out

    def objects(self, prefix: str) -> dict[str, object]:
        """The objects (Megatron ``ShardedObject`` items, ``<key>/shard_...``) whose key is ``prefix``: shard
        name -> object."""
        out = {}
        for (fqn, _), info in self.storage.items():
            key, _, shard = fqn.partition("/")
            if key == prefix:
                out[shard] = load_megatron(self._read(info), where=str(self.dir / info.relative_path))
        return out

    def object(self, key: str, default=None):
        """The value of Megatron's ``ShardedObject`` ``key`` (one shard), as megatron-core gave it to the saver,
        which stores each as a one-item list; ``default`` where the checkpoint has none."""
        found = self.objects(key)
        if not found:
            return default
        if len(found) > 1:
            fail(f"{self.dir} stores {len(found)} shards of {key!r} where megatron-core writes one: the checkpoint "
                 "is damaged or mixes runs")
        (value,) = found.values()
        return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (list, dict)) \
            else value
