"""Which checkpoint a run resumes from: checked against the run's config before any process group exists
(:func:`check_resume`), then verified against its manifest by all ranks together, falling back to the newest
intact tag (:func:`choose_intact`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from llmjp_ds.data.batch_schedule import BatchSchedule
from llmjp_ds.checkpoint.manifest import check_sizes, verify
from llmjp_ds.checkpoint.store import (ARCHITECTURE_KEYS, LATEST, MARKER, SHAPE_KEYS, CheckpointMeta, checkpoint_dir,
                                       complete_tags, latest_tag, parse_marker, saved_layout, tag_dir, vet_tag)
from llmjp_ds.config import blend_history, build_config
from llmjp_ds.errors import UserError, fail
from llmjp_ds.io_utils import atomic_file
from llmjp_ds.optim.lr_schedule import resumed, run_schedule

DAMAGED = ".damaged"


def check_resume(run_dir, model_config: dict, cfg=None, layout=None) -> str | None:
    """The tag a run will resume from (None for a fresh run), checked before any process group exists:
    ``latest`` must name a complete checkpoint, saved from a model of the same shape, with the same kind of LM
    head (an FP8 head carries TE scaling state that a BF16 head has no slot for), dtype and sequence length
    (the samples of every step are cut by it), and, if it was saved on another layout than ``layout`` or
    another ZeRO stage, with ZeRO-1 on both sides (``parallel.reshape``)."""
    latest = latest_tag(run_dir)
    if latest is None:
        return None
    # the newest tag whose marker parses: a damaged one is passed over by choose_intact, after the process group
    tag, marker = next(((t, m) for t in _candidates(run_dir, latest) if (m := _marker_or_none(run_dir, t))),
                       (None, None))
    if marker is None:
        return latest
    where = checkpoint_dir(run_dir) / tag
    saved = marker.model_config
    diff = shape_differences(saved, model_config)
    if diff:
        fail(f"{where} was saved from another model shape ({', '.join(diff)}): resume with the run's own model "
             f"settings, or set a new run_dir to start afresh")
    if cfg is None:
        return tag
    now = {"precision.fp8_lm_head": cfg.precision.fp8_lm_head, "precision.dtype": cfg.precision.dtype,
           "data.seq_len": cfg.data.seq_len or model_config.get("max_position_embeddings")}
    then = {"precision.fp8_lm_head": marker.fp8_lm_head, "precision.dtype": marker.dtype,
            "data.seq_len": marker.seq_len}
    changed = [k for k in now if now[k] != then[k]]
    if changed:
        fail(f"{where} was saved with " + ", ".join(f"{k}={json.dumps(then[k])}" for k in changed) +
             f" (now {', '.join(json.dumps(now[k]) for k in changed)}): resume with the run's own settings, or "
             "set a new run_dir to start afresh")
    check_same_past(marker, cfg, f"{where} (step {marker.step})", "resume from an earlier checkpoint, or branch one "
                    "(llmjp-ds branch)")
    zero = cfg.parallel.zero_stage
    if layout is not None:
        before = saved_layout(run_dir, tag, marker)
        if (before != layout or marker.layout_free or marker.zero_stage != zero) and \
                (marker.zero_stage != 1 or zero != 1):
            fail(f"{where} was saved on {before.name} with ZeRO-{marker.zero_stage}; resuming it on {layout.name} "
                 f"(ZeRO-{zero}) works with ZeRO-1 on both sides only: relaunch on {before.name} with "
                 f"parallel.zero_stage={marker.zero_stage}")
    return tag


def shape_differences(saved: dict, now: dict) -> list[str]:
    """``"<key> <saved> saved, <now> now"`` for each shape or architecture field (a model config's) that differs."""
    return [f"{k} {saved.get(k, default)} saved, {now.get(k, default)} now"
            for k, default in [*((k, None) for k in SHAPE_KEYS), *ARCHITECTURE_KEYS.items()]
            if saved.get(k, default) != now.get(k, default)]


def resumed_schedule(marker: CheckpointMeta, cfg):
    """The LR schedule a resume from ``marker``'s checkpoint continues with: the config's, reconciled with the one
    the checkpoint stored under ``optim.resume_schedule`` (a disagreement under ``check`` fails in one line)."""
    configured = run_schedule(cfg)
    return resumed(configured, marker.lr_schedule if marker is not None else None, cfg.optim.resume_schedule)


def check_same_past(marker: CheckpointMeta, cfg, where: str, fix: str) -> None:
    """The config ``cfg`` gives the steps before the checkpoint of ``marker`` the blends and global batches that
    trained them (its ``run_config``): a blend or batch change at a step already passed would change which samples
    those steps read, and so what the consumed-sample count means. ``where`` names the checkpoint, ``fix`` the way
    out. Checkpoints without a run config (earlier releases, or one this release cannot read) are not checked."""
    if not marker.run_config or not marker.step:
        return
    try:
        then = build_config(marker.run_config)
    except UserError:
        return
    step = marker.step
    before, now = blend_history(then, step), blend_history(cfg, step)
    if before != now:
        changed = next(i for i in range(max(len(before), len(now)))
                       if i >= len(before) or i >= len(now) or before[i] != now[i])
        at = (now if changed < len(now) else before)[changed][0]
        fail(f"the config changes the blend of step {at}, which {where} already trained: give a new blend from "
             f"step {step + 1} on (data.phases with start_step > {step}), or {fix}")
    ours, theirs = BatchSchedule.of(cfg.train), BatchSchedule.of(then.train)
    if ours.pieces(step) != theirs.pieces(step):
        at = next(s for (s, b), other in zip(ours.pieces(step) + [(step, 0)], theirs.pieces(step) + [(step, 0)])
                  if (s, b) != other) + 1  # the step as the records number it
        fail(f"the config changes the global batch of step {at}, which {where} already trained with another: change "
             f"it from step {step + 1} on (train.batch_changes with start_step > {step}), or {fix}")
    if marker.consumed_samples is not None and ours.consumed_at(step) != marker.consumed_samples:
        fail(f"{where} consumed {marker.consumed_samples} samples, but the config's batches give "
             f"{ours.consumed_at(step)} for its {step} steps: resume with the batch settings that trained it, or {fix}")


def choose_intact(run_dir, ctx) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest tag (from ``latest`` down) whose files match its manifest, verified by all ranks of ``ctx``
    together (each reads its share of the files); and the (tag, reason) of each damaged tag passed over,
    newest first. Rank 0 moves a damaged tag aside (``<tag>.damaged``, kept for inspection) and ``latest`` to
    the intact one. Fails with one line if a checkpoint exists and none is intact."""
    latest = latest_tag(run_dir)
    if latest is None:
        return None, []
    damaged = []
    for tag in _candidates(run_dir, latest):
        d = vet_tag(run_dir, tag)  # a link out of the tag is tampering, not damage: refused, not passed over
        try:
            marker = parse_marker(d / MARKER)
        except ValueError as exc:  # a marker that does not parse is damage like any other
            damaged.append((tag, f"its marker is not valid ({exc})"))
            continue
        reason = verify_tag(d, marker, ctx.rank, ctx.layout.world)
        reasons = [None] * ctx.layout.world
        dist.all_gather_object(reasons, reason)
        reason = next((r for r in reasons if r), None)
        if reason is None:
            if damaged and ctx.rank == 0:
                _set_aside(run_dir, [t for t, _ in damaged], tag)
            ctx.barrier()
            return tag, damaged
        damaged.append((tag, reason))
    fail(f"no intact checkpoint in {checkpoint_dir(run_dir)}: " + "; ".join(f"{t}: {r}" for t, r in damaged[:4]) +
         ". Restore the files from a copy, or set a new run_dir to start afresh")


def verify_tag(d: Path, marker: CheckpointMeta, rank: int = 0, world: int = 1) -> str | None:
    """Why the checkpoint in ``d`` does not match its manifest (sizes of all files; checksums of this rank's
    share, every ``world``-th file from ``rank``); None if it does."""
    if marker.files is None:
        return "it has no manifest (written by an earlier release of llmjp-ds)"
    return check_sizes(d, marker.files) or verify(d, marker.files, sorted(marker.files)[rank::world])


def _candidates(run_dir, latest: str) -> list[str]:
    """``latest``, then the older complete tags, newest first."""
    return [latest, *(t for s, t in reversed(complete_tags(run_dir)) if t != latest and s <= int(latest[4:12]))]


def _marker_or_none(run_dir, tag: str) -> CheckpointMeta | None:
    try:
        return parse_marker(tag_dir(run_dir, tag) / MARKER)
    except ValueError:
        return None


def _set_aside(run_dir, damaged: list[str], intact: str) -> None:
    root = checkpoint_dir(run_dir)
    for tag in damaged:
        aside, n = root / f"{tag}{DAMAGED}", 1
        while aside.exists():
            n += 1
            aside = root / f"{tag}{DAMAGED}-{n}"
        if (root / tag).is_dir() and not (root / tag).is_symlink():
            os.replace(root / tag, aside)
    with atomic_file(root / LATEST, "w") as f:
        f.write(intact)
