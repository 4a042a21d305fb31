"""Which checkpoint a run resumes from: checked against the run's config before any process group exists
(:func:`check_resume`), then verified against its manifest by all ranks together, falling back to the newest
intact tag (:func:`choose_intact`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmjp_ds.checkpoint.store import (LATEST, MARKER, SHAPE_KEYS, CheckpointMeta, checkpoint_dir, complete_tags,
                                       latest_tag, parse_marker, saved_layout, tag_dir, vet_tag)
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import atomic_file

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
    diff = [f"{k} {saved.get(k)} saved, {model_config.get(k)} now"
            for k in SHAPE_KEYS if saved.get(k) != model_config.get(k)]
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
    zero = cfg.parallel.zero_stage
    if layout is not None:
        before = saved_layout(run_dir, tag, marker)
        if (before != layout or marker.layout_free or marker.zero_stage != zero) and \
                (marker.zero_stage != 1 or zero != 1):
            fail(f"{where} was saved on {before.name} with ZeRO-{marker.zero_stage}; resuming it on {layout.name} "
                 f"(ZeRO-{zero}) works with ZeRO-1 on both sides only: relaunch on {before.name} with "
                 f"parallel.zero_stage={marker.zero_stage}")
    return tag


def choose_intact(run_dir, ctx) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest tag (from ``latest`` down) whose files match its manifest, verified by all ranks of ``ctx``
    together (each reads its share of the files); and the (tag, reason) of each damaged tag passed over,
    newest first. Rank 0 moves a damaged tag aside (``<tag>.damaged``, kept for inspection) and ``latest`` to
    the intact one. Fails with one line if a checkpoint exists and none is intact."""
    import torch.distributed as dist

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
    from llmjp_ds.checkpoint.manifest import check_sizes, verify

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
