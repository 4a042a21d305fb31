"""Saving a checkpoint without stopping training: a snapshot into host memory, then a background writer.

DeepSpeed's engine hands every file of a checkpoint to its checkpoint engine (``save(state_dict, path)``). Under
``checkpoint.async_save`` that call only copies the state: every tensor into page-locked host memory (from the
GPU asynchronously, one synchronisation at the end; a CPU tensor is cloned), every container rebuilt, anything
else deep-copied, so the next optimizer step cannot change what is written. One thread per rank then writes the
files (hashed and fsynced as in a synchronous save) while the loop trains on.

What a crash guarantees does not change: a background write only produces files under a tag without a marker.
The marker with its manifest, and ``latest``, are written by the same commit step as a synchronous save, on the
main thread, once every rank's writer has finished (``checkpoint.store.commit``); a kill -9 before that leaves
``latest`` on the previous intact tag.

Page-locking 25 GB of host memory takes longer than copying into it (11-18 s against ~1 s for a 1.8B model on an
H200), so it happens once, before the first step: :meth:`AsyncSaver.reserve` pins a :class:`PinnedArena` of the
estimated snapshot size, and every save cuts its tensors from it. Each tensor owns exactly its bytes of the arena
(``torch.frombuffer`` of a slice), so ``torch.save`` writes only those. A save reuses the arena only once the
previous one is committed; a snapshot larger than the arena takes fresh pinned memory for the rest.
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

from llmjp_ds.checkpoint.manifest import save_hashed
from llmjp_ds.checkpoint.store import commit, report_failed_save
from llmjp_ds.errors import fail
from llmjp_ds.launch.failure import PeerFailure
from llmjp_ds.parallel.memory import GIB, SHARDED_BYTES

# a drill (tests, rehearsals): the writer sleeps this long before each file, to widen the in-flight window
SLOW_WRITE_ENV = "LLMJP_DS_DRILL_SLOW_WRITE_S"
WRITERS = 4  # files written at once by a rank's writer


class PinnedArena:
    """Host memory allocated (and, with ``pin``, page-locked) once, handed out as tensors that each own their
    slice; :meth:`reset` makes all of it free again (the previous snapshot is written)."""

    ALIGN = 4096

    def __init__(self, nbytes: int, pin: bool):
        self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = pin and _page_lock(self._buffer)
        self._bytes = self._buffer.numpy()
        self.nbytes, self.used = nbytes, 0

    def take(self, shape, dtype) -> torch.Tensor | None:
        """An uninitialised tensor of ``shape`` and ``dtype`` from the arena; None when it does not fit."""
        size = math.prod(shape) * dtype.itemsize
        start = -(-self.used // self.ALIGN) * self.ALIGN
        if start + size > self.nbytes:
            return None
        self.used = start + size
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(memoryview(self._bytes[start:start + size]), dtype=dtype).view(shape)

    def reset(self) -> None:
        self.used = 0


def _page_lock(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` in place for asynchronous device copies (CUDA's ``cudaHostRegister``: exactly its
    size, where torch's pinned allocator would round up to a power of two); False where that is not possible."""
    if not torch.cuda.is_available():
        return False
    try:
        return int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) == 0
    except (AttributeError, RuntimeError):
        return False


def snapshot(obj, pinned: bool, arena: PinnedArena | None = None):
    """A copy of ``obj`` that later in-place updates of its tensors do not reach: into ``arena`` while it has
    room, else into fresh (``pinned``: page-locked) host memory. Device tensors are copied asynchronously: call
    ``torch.cuda.synchronize()`` before reading them."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        out = arena.take(t.shape, t.dtype) if arena is not None else None
        if out is None:
            if t.device.type == "cpu":
                return t.clone()
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)  # compact: a view saves its values only
        out.copy_(t, non_blocking=t.device.type != "cpu" and (pinned or arena.pinned))
        return out
    if isinstance(obj, dict):
        items = [(k, snapshot(v, pinned, arena)) for k, v in obj.items()]
        return dict(items) if type(obj) is dict else type(obj)(items)
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v, pinned, arena) for v in obj)
    if isinstance(obj, (int, float, str, bool, bytes, type(None))):
        return obj
    return copy.deepcopy(obj)


def nbytes(obj) -> int:
    """The tensor bytes in ``obj`` (what its snapshot holds in host memory)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


class AsyncSaver:
    """This rank's background writer: :meth:`add` snapshots a file's state, :meth:`start` writes them all in a
    thread; :meth:`done`, :meth:`wait`, :attr:`meta` (the tag's marker) and :attr:`error` (the first failure, with
    its path) for the commit."""

    def __init__(self):
        self.tag: str | None = None
        self.step = 0
        self.meta = None  # the CheckpointMeta the commit writes as the tag's marker (kept or not)
        self.jobs: list[tuple[str, object]] = []
        self.written: dict[str, dict] = {}
        self.error: tuple[BaseException, str] | None = None
        self.snapshot_bytes = 0
        self.write_s = 0.0
        self._thread: threading.Thread | None = None
        self._root: Path | None = None
        self.arena: PinnedArena | None = None

    def reserve(self, nbytes: int) -> float:
        """Allocate the host memory of the snapshots now (before the loop); returns the seconds it took."""
        t0 = time.perf_counter()
        self.arena = PinnedArena(nbytes, pin=torch.cuda.is_available())
        return time.perf_counter() - t0

    @property
    def in_flight(self) -> bool:
        return self.tag is not None

    def begin(self, tag: str, step: int, tag_dir: Path, meta) -> None:
        self.tag, self.step, self._root = tag, step, tag_dir.resolve()
        self.jobs, self.written, self.error = [], {}, None
        self.meta = meta
        self.snapshot_bytes = 0
        if self.arena is not None:
            self.arena.reset()  # the previous snapshot is committed (or failed): its bytes are free

    def add(self, state, path) -> None:
        """DeepSpeed's ``checkpoint_engine.save``: snapshot now, write later."""
        self.jobs.append((str(path), snapshot(state, pinned=torch.cuda.is_available(), arena=self.arena)))
        self.snapshot_bytes += nbytes(self.jobs[-1][1])

    def start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device-to-host copies are done: the step may change the weights now
        self._thread = threading.Thread(target=self._write, name="llmjp-ds-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        """Write every file, a few at a time (the big optimizer shard and the model states overlap)."""
        t0 = time.perf_counter()
        jobs, self.jobs = self.jobs, []
        with ThreadPoolExecutor(max_workers=min(WRITERS, max(1, len(jobs)))) as pool:
            list(pool.map(self._write_one, jobs))
        self.write_s = time.perf_counter() - t0

    def _write_one(self, job) -> None:
        path, state = job
        delay = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)
        if delay:
            time.sleep(delay)
        if self.error is not None:
            return
        try:
            self.written[Path(path).resolve().relative_to(self._root).as_posix()] = save_hashed(state, path)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
            self.error = self.error or (exc, path)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def finish(self) -> None:
        """Forget the committed (or failed) save."""
        self.tag, self._thread, self.jobs = None, None, []


def commit_when_done(saver: AsyncSaver, ctx, run_dir, keep_last: int, block: bool) -> bool:
    """Commit ``saver``'s checkpoint, with the marker it was begun with, once every rank's writer is done
    (``block``: wait for this rank's first); True when no save is left in flight. A rank whose write failed ends
    with the one line of a failed save (the path, the free space, what ``latest`` still names); the others end
    quietly at the same point."""
    if not saver.in_flight:
        return True
    if block:
        saver.wait()
    if ctx.any_rank(not saver.done()):
        return False
    if ctx.any_rank(saver.error is not None):
        if saver.error is not None:
            report_failed_save(run_dir, saver.tag, *saver.error)
        raise PeerFailure(f"another rank's background write of checkpoint {saver.tag} failed")
    commit(run_dir, saver.tag, saver.step, saver.meta, saver.written, keep_last)
    saver.finish()
    return True


def smallest_interval(write_s: float, step_s: float) -> int:
    """The fewest steps between saves for which a background write of ``write_s`` seconds ends before the next
    save begins, at ``step_s`` seconds a step."""
    return max(1, math.ceil(write_s / max(step_s, 1e-9)))


def seconds(value: float) -> str:
    """A duration as the advice says it: three significant digits (26, 8.4, 0.012)."""
    return f"{value:.3g}"


def _apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` in seconds with as many decimals as it takes to tell them apart (up to 4)."""
    for decimals in range(1, 5):
        texts = f"{a:.{decimals}f}", f"{b:.{decimals}f}"
        if texts[0] != texts[1]:
            break
    return texts


def interval_advice(snapshot_gib: float, write_s: float, interval_steps: int, step_s: float,
                    busy_s: float | None = None) -> str:
    """Why a save waits for the previous write, with the numbers (the write's size, speed and time, the interval
    in steps and seconds) and the smallest ``checkpoint.interval`` that would not wait: the trainer says it the
    first time a save waits, and ``llmjp-ds preflight --disk-gbps`` from the estimated snapshot. ``busy_s``: what
    the trainer measured, the time from the previous save's start to its write's end (its snapshot too), which the
    interval must exceed; by default the write's time."""
    gbps = snapshot_gib * 2**30 / 1e9 / max(write_s, 1e-9)
    busy, interval = _apart(write_s if busy_s is None else busy_s, interval_steps * step_s)
    took = (f"in {busy} s" if busy_s is None else
            f"in {seconds(write_s)} s, and that save took {busy} s from its start to its write's end")
    return (f"a background save writes {snapshot_gib:.2f} GiB at {gbps:.2f} GB/s {took}, longer than "
            f"checkpoint.interval={interval_steps} steps ({interval} s at {step_s:.2f} s a step), so each save waits "
            f"for the previous write: set checkpoint.interval to at least "
            f"{smallest_interval(write_s if busy_s is None else busy_s, step_s)}, or write the run directory to a "
            "faster disk")


def arena_bytes(module, dp_rank: int, dp_size: int) -> int:
    """The arena this rank reserves: its snapshot (the weights if it writes the model states, i.e. data-parallel
    rank 0, and its ZeRO shard of fp32 master weights and Adam moments), with room for alignment, buffers and the
    small states."""
    numel = sum(p.numel() for p in module.parameters())
    weights = sum(p.numel() * p.element_size() for p in module.parameters()) if dp_rank == 0 else 0
    return int((weights + SHARDED_BYTES * numel / dp_size) * 1.01) + (64 << 20)


def check_host_memory(nbytes: int, ranks_per_node: int) -> None:
    """Fail with one line where the node's available memory cannot hold its snapshots, counted as if every
    local rank reserved ``nbytes`` as this one does (an upper bound where this rank writes the model states)."""
    need = ranks_per_node * nbytes / GIB
    available = psutil.virtual_memory().available / 2**30
    if need > 0.9 * available:
        fail(f"checkpoint.async_save needs ~{need:.1f} GiB of host memory on this node for its snapshots "
             f"({ranks_per_node} ranks), but {available:.1f} GiB are available: set checkpoint.async_save=false "
             "(saves then stop training while they write), or run on nodes with more memory")
