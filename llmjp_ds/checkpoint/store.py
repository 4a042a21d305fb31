"""The checkpoint store of a run directory: tags, the marker with its manifest, ``latest``, saving, pruning.

Layout of a run directory::

    <run_dir>/.llmjp_ds.lock              held by the one training that owns the directory (checkpoint/lock.py)
    <run_dir>/config.yaml                 the resolved run config
    <run_dir>/tokenizer/                  the tokenizer (HF files + tokenizer.model), exported with the model
    <run_dir>/checkpoints/step00000100/   DeepSpeed's files for that step + llmjp_ds.json (written last)
    <run_dir>/checkpoints/latest          names the newest complete checkpoint; moved only after a save is done
    <run_dir>/metrics.jsonl, wandb/

A save writes DeepSpeed's files (each rank hashes and fsyncs what it writes), waits for every rank, then rank 0
writes the ``llmjp_ds.json`` marker, whose ``files`` manifest gives every file's size and xxh3 checksum, and
replaces ``latest`` atomically, then deletes checkpoints beyond ``keep_last`` (never one whose marker says
``kept``: a log-spaced save of ``checkpoint.keep``). A kill at any moment leaves ``latest`` naming a complete
checkpoint; a resume verifies the tag against its manifest first and falls back to the newest tag that verifies
(``checkpoint/resume.py``).

Every path the store touches is resolved inside the run's ``checkpoints/``: a tag is a name of the form
``stepNNNNNNNN[-rN]`` (never a path), a tag that is a symbolic link is neither read nor followed when deleting.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch.distributed as dist

from llmjp_ds.checkpoint.manifest import digest, save_hashed, tag_files
from llmjp_ds.checkpoint.safe_load import load_checkpoint_file
from llmjp_ds.config import seq_len_of
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import atomic_file, free_space
from llmjp_ds.launch.failure import is_peer_failure
from llmjp_ds.parallel.deepspeed_internals import route_checkpoint_io
from llmjp_ds.parallel.layout import Layout
from llmjp_ds.parallel.reshape import saved_layout as from_files

MARKER = "llmjp_ds.json"
LATEST = "latest"
_TAG = re.compile(r"^step(\d{8})(?:-r(\d+))?$")


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int, rollbacks: int = 0) -> str:
    return f"step{step:08d}" + (f"-r{rollbacks}" if rollbacks else "")


def tag_dir(run_dir, tag: str, source: str = "--tag") -> Path:
    """The directory of checkpoint ``tag`` (as ``source`` names it), refused unless ``tag`` is a tag name (not a
    path) whose directory lies inside the run's ``checkpoints/`` (a symbolic link out of it is refused too)."""
    root = checkpoint_dir(run_dir)
    if not isinstance(tag, str) or not _TAG.match(tag):
        known = ", ".join(t for _, t in complete_tags(run_dir)[-3:]) or "none (no checkpoint yet)"
        fail(f"{source} names {tag!r}, which is not a checkpoint tag of {root} (tags look like step00000100, never "
             f"a path): pass one of {known}")
    path = root / tag
    if path.is_symlink() or (path.exists() and path.resolve().parent != root.resolve()):
        fail(f"{path} is a symbolic link (to {os.path.realpath(path)}): llmjp-ds reads only checkpoints inside the "
             f"run's checkpoints/; copy the checkpoint there instead")
    return path


def vet_tag(run_dir, tag: str) -> Path:
    """The directory of ``tag``, refused unless every file under it is a regular file inside it."""
    d = tag_dir(run_dir, tag)
    for path in d.rglob("*"):
        if path.is_symlink():
            fail(f"{path} is a symbolic link (to {os.path.realpath(path)}): llmjp-ds reads only the files inside "
                 "a checkpoint's own directory; replace the link by the file")
    return d


def complete_tags(run_dir) -> list[tuple[int, str]]:
    """(step, tag) of every complete checkpoint (a real directory with a marker), oldest first."""
    root = checkpoint_dir(run_dir)
    out = []
    if root.is_dir():
        for d in root.iterdir():
            m = _TAG.match(d.name)
            if m and not d.is_symlink() and (d / MARKER).is_file():
                out.append((int(m.group(1)), int(m.group(2) or 0), d.name))
    return [(step, tag) for step, _, tag in sorted(out)]


def _read_latest(run_dir) -> str | None:
    path = checkpoint_dir(run_dir) / LATEST
    if not path.is_file():
        return None
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{path} cannot be read ({exc}): point it at one of {[t for _, t in complete_tags(run_dir)][-3:]}")


def latest_tag(run_dir) -> str | None:
    """The tag ``latest`` names (None without one), refused unless it is a complete checkpoint of this run."""
    tag = _read_latest(run_dir)
    if tag is None:
        return None
    path = tag_dir(run_dir, tag, source=str(checkpoint_dir(run_dir) / LATEST))
    if not (path / MARKER).is_file():
        fail(f"{checkpoint_dir(run_dir) / LATEST} names {tag!r}, which is not a complete checkpoint: the run "
             f"directory was altered by hand; point latest at one of {[t for _, t in complete_tags(run_dir)][-3:]}")
    return tag


@dataclass
class CheckpointMeta:
    """What a checkpoint's marker (``llmjp_ds.json``) records: enough to check a resume and to read the weights
    back without the run config, and the manifest of its files. Written last: its presence means the
    checkpoint is complete."""

    model_config: dict
    zero_stage: int
    pipeline_stages: int
    dtype: str
    seq_len: int
    fp8_lm_head: bool = False
    data_parallel: int | None = None  # None in checkpoints of earlier releases (the files tell)
    tensor_parallel: int = 1
    # an MoE model's experts split over groups of this many data-parallel ranks (DeepSpeed's MoE checkpoint: the
    # experts in files of their own, one per expert)
    expert_parallel: int = 1
    step: int | None = None
    tag: str | None = None
    files: dict | None = None  # relative path -> {"size", "xxh3"}; None in checkpoints of earlier releases
    # the tag holds only the layout-free form (parallel/reshape.py; import-megatron writes such a tag): every
    # resume reads its parameters from there, whatever the layout
    layout_free: bool = False
    # saved for a rule of checkpoint.keep: rotation (prune) never deletes it, whatever the rules are now
    kept: bool = False
    # the samples consumed before step ``step``, and the resolved run config that trained up to it (RunConfig's
    # dict): a resume checks that the steps behind it keep their blend and batches, a branch starts from it
    consumed_samples: int | None = None
    run_config: dict | None = None
    # the LR schedule at this checkpoint (megatron-core's opt_param_scheduler state_dict; lr_schedule.LRSchedule):
    # a resume reconciles the config's with it under optim.resume_schedule before anything else runs
    lr_schedule: dict | None = None
    # the steps the run skipped before this checkpoint ([first, last] each: train.skip_steps and its rollbacks'):
    # `llmjp-ds samples --run` leaves their samples out, a branch keeps them skipped
    skip_steps: list | None = None

    @classmethod
    def for_run(cls, cfg, model_config, data_parallel: int) -> "CheckpointMeta":
        return cls(model_config=model_config.to_dict(), zero_stage=cfg.parallel.zero_stage,
                   pipeline_stages=cfg.parallel.pipeline_stages, dtype=cfg.precision.dtype,
                   seq_len=seq_len_of(cfg, model_config), fp8_lm_head=cfg.precision.fp8_lm_head,
                   data_parallel=data_parallel, tensor_parallel=cfg.parallel.tensor_parallel,
                   expert_parallel=cfg.parallel.expert_parallel, run_config=cfg.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> "CheckpointMeta":
        """The marker's fields, each checked for its type (a marker is a file anyone could have edited)."""
        if not isinstance(data, dict):
            raise ValueError(f"holds a {type(data).__name__}, not an object")
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)}")
        meta = cls(**{k: v for k, v in data.items() if k in known})
        if not isinstance(meta.model_config, dict) or not all(
                isinstance(meta.model_config.get(k), int) and not isinstance(meta.model_config.get(k), bool)
                and meta.model_config.get(k) > 0 for k in SHAPE_KEYS):
            raise ValueError(f"model_config must be an object with positive integer {', '.join(SHAPE_KEYS)}")
        for name in ("zero_stage", "pipeline_stages", "seq_len", "tensor_parallel", "expert_parallel"):
            value = getattr(meta, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("layout_free", "kept"):
            if not isinstance(getattr(meta, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(meta, name)!r}")
        if meta.consumed_samples is not None and (not isinstance(meta.consumed_samples, int) or isinstance(
                meta.consumed_samples, bool) or meta.consumed_samples < 0):
            raise ValueError(f"consumed_samples must be a non-negative integer, got {meta.consumed_samples!r}")
        if meta.skip_steps is not None and not (isinstance(meta.skip_steps, list) and all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in meta.skip_steps)):
            raise ValueError("skip_steps must be a list of [first, last] step ranges")
        for name in ("run_config", "lr_schedule"):
            if getattr(meta, name) is not None and not isinstance(getattr(meta, name), dict):
                raise ValueError(f"{name} must be an object, got {type(getattr(meta, name)).__name__}")
        if meta.files is not None and not (isinstance(meta.files, dict) and all(
                isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("size"), int)
                and isinstance(v.get("xxh3"), str) for k, v in meta.files.items())):
            raise ValueError("files must map each file to its size and xxh3")
        return meta

    def to_dict(self) -> dict:
        return asdict(self)


def parse_marker(path: Path) -> CheckpointMeta:
    """The marker at ``path``; ``ValueError`` (with the reason) if it does not parse or its fields are wrong."""
    try:
        return CheckpointMeta.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError, OSError) as exc:
        raise ValueError(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__) from exc


def read_marker(run_dir, tag: str) -> CheckpointMeta:
    path = tag_dir(run_dir, tag) / MARKER
    if not path.is_file():
        known = [t for _, t in complete_tags(run_dir)]
        fail(f"no complete checkpoint {tag!r} in {checkpoint_dir(run_dir)}: available tags are "
             f"{', '.join(known[-5:]) or 'none'}")
    try:
        return parse_marker(path)
    except ValueError as exc:
        fail(f"{path} is not a valid checkpoint marker ({exc}): the checkpoint was damaged or altered by hand; "
             f"point {LATEST} at another tag")


# the fields that fix the weights' shapes: a checkpoint of another shape cannot be loaded into this model
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")
# and what makes a model another kind of model (qk-norm, experts), each with a dense Llama's value (a checkpoint of
# an earlier release stored none of them)
ARCHITECTURE_KEYS = {"model_type": "llama", "num_experts": None, "num_local_experts": None, "num_experts_per_tok": None,
                     "moe_intermediate_size": None, "mlp_only_layers": None}


def saved_layout(run_dir, tag: str, marker: CheckpointMeta) -> Layout:
    """The layout of the run that wrote checkpoint ``tag``."""
    if marker.data_parallel is not None:
        pipeline, data, tensor = marker.pipeline_stages, marker.data_parallel, marker.tensor_parallel
    else:
        (pipeline, data), tensor = from_files(checkpoint_dir(run_dir) / tag), 1
    return Layout(world=pipeline * data * tensor, pipeline=pipeline, tensor=tensor, expert=marker.expert_parallel)


# --- saving ----------------------------------------------------------------------------------------------

def save(engine, run_dir, step: int, client_state: dict, meta: CheckpointMeta, keep_last: int,
         rollbacks: int = 0, saver=None) -> str:
    """Save checkpoint ``step``: DeepSpeed's files, then (:func:`commit`) the marker ``meta`` and ``latest``. With
    an :class:`~llmjp_ds.checkpoint.async_save.AsyncSaver` the files are only snapshotted here and written in the
    background; the caller commits (with the ``meta`` the saver holds) once every rank's writer is done."""
    root = checkpoint_dir(run_dir)
    tag = tag_for(step, rollbacks)
    target = tag_dir(run_dir, tag)
    # a run resumed behind a complete tag (killed between its marker and `latest`) saves that tag again, in
    # place: each rank drops the old marker before it rewrites files, so a marker always means complete files
    if _read_latest(run_dir) != tag:
        (target / MARKER).unlink(missing_ok=True)
    written: dict[str, dict] = {}
    writing: list[Path] = []  # the file this rank writes now: the one a failed write cut
    if saver is not None:
        saver.begin(tag, step, target, meta)
        write = saver.add
    else:
        def write(state, path):
            writing[:] = [Path(path)]
            written[Path(path).resolve().relative_to(target.resolve()).as_posix()] = save_hashed(state, path)
    route_checkpoint_io(engine, load_checkpoint_file, write)
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        if is_peer_failure(exc):  # another rank died inside DeepSpeed's save: that rank says why
            raise
        report_failed_save(run_dir, tag, exc, cut=writing[0] if writing else None, peers_writing=True)
    if saver is not None:
        saver.start()
        return tag
    commit(run_dir, tag, step, meta, written, keep_last)
    return tag


def commit(run_dir, tag: str, step: int, meta: CheckpointMeta, written: dict, keep_last: int) -> None:
    """Every rank: its files of ``tag`` are complete, ``written`` their manifest entries. Rank 0 writes the
    marker with the whole manifest, then ``latest``, then prunes; all ranks leave together."""
    root, target = checkpoint_dir(run_dir), checkpoint_dir(run_dir) / tag
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, written)
    if dist.get_rank() == 0:
        files = {k: v for part in gathered for k, v in part.items()}
        try:
            for name in tag_files(target, exclude=(MARKER, *files)):  # what DeepSpeed wrote another way
                files[name] = digest(target / name)
            with atomic_file(target / MARKER, "w", make_parents=False) as f:
                json.dump({**meta.to_dict(), "step": step, "tag": tag, "files": dict(sorted(files.items()))}, f,
                          indent=1)
            with atomic_file(root / LATEST, "w", make_parents=False) as f:
                f.write(tag)
        except OSError as exc:
            report_failed_save(run_dir, tag, exc)
        prune(run_dir, keep_last)
    dist.barrier()


def report_failed_save(run_dir, tag: str, exc: BaseException, path=None, cut=None, peers_writing=False):
    """A write of the save failed (full disk, quota, I/O error): drop the partial tag, say what ``latest`` still
    names (and the file, for a background write), stop. Under several ranks the others stop at their next
    collective (or the process-group timeout).

    ``peers_writing``: the other ranks may still be writing into the tag (a synchronous save under several
    ranks), so only ``cut``, this rank's partial file, is removed; the rest of the tag, which has no marker, goes
    when the run starts again (:func:`prune_incomplete`)."""
    root = checkpoint_dir(run_dir)
    if peers_writing and dist.is_initialized() and dist.get_world_size() > 1:
        if cut is not None and not Path(cut).is_symlink() and (root / tag).resolve() in Path(cut).resolve().parents:
            Path(cut).unlink(missing_ok=True)
    elif not (root / tag / MARKER).is_file():
        remove_tag(run_dir, tag)
    reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    if "unexpected pos" in reason:  # torch's zip writer, when the OS refused part of a write
        reason = "a write was cut short"
    free = free_space(root)
    latest = _read_latest(run_dir)
    what = f"writing {path} in the background" if path else f"saving checkpoint {tag} to {root}"
    fail(f"{what} failed ({reason}; {free}): is the disk full? Free space or lower "
         f"checkpoint.keep_last, then resume; {LATEST} still names "
         + (f"the complete checkpoint {latest}" if latest else "no checkpoint (nothing was saved yet)"))


# --- deleting: only inside checkpoints/, never through a link -------------------------------------------

def remove_tag(run_dir, tag: str) -> None:
    """Delete a checkpoint, its marker first: a kill in the middle leaves an incomplete tag (pruned later), never
    a marker over missing files. A tag that is a symbolic link loses the link only, never what it points to."""
    root = checkpoint_dir(run_dir)
    path = root / tag
    if not _TAG.match(tag):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    if path.resolve().parent != root.resolve():
        return  # not ours (a bind mount, a moved root): leave it
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)  # rmtree does not follow links inside the tree


def prune(run_dir, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` and any incomplete ones left by a kill. A tag
    whose marker says ``kept`` (a save of ``checkpoint.keep``) is never deleted and not counted in ``keep_last``,
    nor is the one ``latest`` names."""
    latest = _read_latest(run_dir)
    tags = [t for _, t in complete_tags(run_dir)]
    kept = {t for t in tags if _marked_kept(run_dir, t)}
    rotated = [t for t in tags if t not in kept]
    _delete_all_but(run_dir, kept | set(rotated[-keep_last:]) | {latest})


def _marked_kept(run_dir, tag: str) -> bool:
    """Whether the marker of complete ``tag`` says kept; a marker that does not parse rotates like any tag."""
    try:
        return parse_marker(checkpoint_dir(run_dir) / tag / MARKER).kept
    except ValueError:
        return False


def prune_incomplete(run_dir) -> None:
    """Delete the incomplete checkpoints (no marker) a kill or a failed save left, but the one ``latest`` names;
    at start, by the run directory's owner, before anything writes there."""
    if checkpoint_dir(run_dir).is_dir():
        _delete_all_but(run_dir, {t for _, t in complete_tags(run_dir)} | {_read_latest(run_dir)})


def _delete_all_but(run_dir, keep: set) -> None:
    for d in checkpoint_dir(run_dir).iterdir():
        if _TAG.match(d.name) and d.name not in keep and (d.is_dir() or d.is_symlink()):
            remove_tag(run_dir, d.name)
        elif d.name.startswith(".") and d.name.endswith(".tmp") and d.is_file() and not d.is_symlink():
            d.unlink(missing_ok=True)  # an atomic_file temp (latest, marker) left by a kill -9


def discard_after(run_dir, step: int) -> None:
    """Delete the checkpoints of an abandoned timeline (steps after ``step``), e.g. after an FP8 rollback, so
    that pruning by step number and a later rollback only ever see the timeline that continues. Kept saves
    (``checkpoint.keep``) of that timeline go too: their weights are those of the run that diverged."""
    for tag_step, tag in complete_tags(run_dir):
        if tag_step > step:
            remove_tag(run_dir, tag)
