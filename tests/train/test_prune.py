"""Deleting a checkpoint can be killed halfway: it must never leave a marker over missing files."""

from __future__ import annotations

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
