"""Deleting a checkpoint can be killed halfway: it must never leave a marker over missing files. Rotation keeps
the newest ``keep_last`` tags, ``latest`` and every tag whose marker says kept (``checkpoint.keep``)."""

from __future__ import annotations

import json
import shutil

import pytest

from llmjp_ds import checkpoint


def make_tag(run_dir, step):
    d = checkpoint.checkpoint_dir(run_dir) / checkpoint.tag_for(step)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (d / checkpoint.MARKER).write_text("{}")
    return d


def test_a_delete_killed_before_any_file_went_leaves_no_complete_tag(tmp_path, monkeypatch):
    make_tag(tmp_path, 4)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies inside rmtree, before it removed anything

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.remove_tag(tmp_path, "step00000004")
    assert checkpoint.complete_tags(tmp_path) == []


def test_prune_keeps_the_newest_complete_tags_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        make_tag(tmp_path, step)
    (checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST).write_text("step00000002")
    checkpoint.prune(tmp_path, keep_last=1)
    assert [t for _, t in checkpoint.complete_tags(tmp_path)] == ["step00000002", "step00000004"]


def make_marked_tag(run_dir, step, kept: bool):
    """A complete tag whose marker parses, saying ``kept`` (a save of checkpoint.keep) or not."""
    from llmjp_ds.checkpoint.store import SHAPE_KEYS

    d = make_tag(run_dir, step)
    meta = checkpoint.CheckpointMeta(model_config=dict.fromkeys(SHAPE_KEYS, 8), zero_stage=1, pipeline_stages=1,
                                     dtype="fp32", seq_len=32, step=step, tag=d.name, kept=kept)
    (d / checkpoint.MARKER).write_text(json.dumps(meta.to_dict()))
    return d


def test_prune_never_deletes_kept_tags_and_rotates_the_others(tmp_path):
    """keep_last counts only the tags whose marker does not say kept; kept tags and latest survive, whatever
    checkpoint.keep says now (prune reads the markers, not the rules)."""
    for step in range(1, 8):
        make_marked_tag(tmp_path, step, kept=step in (1, 2, 5))
    (checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST).write_text("step00000003")
    checkpoint.prune(tmp_path, keep_last=1)
    assert [s for s, _ in checkpoint.complete_tags(tmp_path)] == [1, 2, 3, 5, 7]
    make_marked_tag(tmp_path, 8, kept=False)
    (checkpoint.checkpoint_dir(tmp_path) / checkpoint.LATEST).write_text("step00000008")
    checkpoint.prune(tmp_path, keep_last=1)
    assert [s for s, _ in checkpoint.complete_tags(tmp_path)] == [1, 2, 5, 8]


def test_a_marker_that_does_not_parse_rotates_and_a_kept_that_is_not_a_bool_is_refused(tmp_path):
    make_tag(tmp_path, 1)  # marker "{}": not a valid marker, so not a kept save
    make_marked_tag(tmp_path, 2, kept=False)
    make_marked_tag(tmp_path, 3, kept=False)
    checkpoint.prune(tmp_path, keep_last=1)
    assert [s for s, _ in checkpoint.complete_tags(tmp_path)] == [3]
    marker = json.loads((make_marked_tag(tmp_path, 4, kept=True) / checkpoint.MARKER).read_text())
    with pytest.raises(ValueError, match="kept must be true or false"):
        checkpoint.CheckpointMeta.from_dict({**marker, "kept": "yes"})


def test_discard_after_a_rollback_removes_kept_tags_of_the_abandoned_timeline(tmp_path):
    for step in (2, 4, 6):
        make_marked_tag(tmp_path, step, kept=True)
    checkpoint.discard_after(tmp_path, 4)
    assert [s for s, _ in checkpoint.complete_tags(tmp_path)] == [2, 4]
