"""A fine-tune start (``model.init_from_checkpoint``, Megatron-LM's ``--finetune``): a new run whose first step
starts from another run's weights, with a new optimizer, LR schedule and data position. The new run's first step runs
at LR 0 (Megatron's warm-up starts there), so the checkpoint it saves after that step holds the source's weights
exactly, whatever the layout it loads them on; its record starts at step 1 and sample 0."""

from __future__ import annotations

import pytest
import torch

from llmjp_ds import checkpoint
from llmjp_ds.metrics.record import read_metrics

from tests.runs import run_train, trail

pytestmark = pytest.mark.slow


def weights(run_dir, tag: str) -> dict:
    marker = checkpoint.read_marker(run_dir, tag)
    return {k: v for k, v in checkpoint.read_model_state(run_dir, tag, marker).items()
            if not k.endswith("_extra_state")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc, layout", [(1, ()), (2, ("parallel.pipeline_stages=2",))], ids=["single", "pp2"])
def test_a_finetune_start_takes_the_weights_alone(train_env, tmp_path, nproc, layout):
    source = run_train(tmp_path / "source", 1, "train.steps=3")
    tag = checkpoint.tag_for(3)
    start = run_train(tmp_path / "finetune", nproc, *layout, "train.steps=1", "optim.schedule=megatron",
                      f"model.init_from_checkpoint={source / 'checkpoints' / tag}")
    records = trail(start)
    assert [(r["step"], r["consumed_samples"], r["lr"]) for r in records] == [(1, 8, 0.0)]
    events = [e for e in read_metrics(start) if e.get("event") == "finetune"]
    assert [(e["tag"], e["source_step"]) for e in events] == [(tag, 3)]
    ours, theirs = weights(start, checkpoint.tag_for(1)), weights(source, tag)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    fresh = run_train(tmp_path / "fresh", 1, "train.steps=1", "optim.schedule=megatron")
    assert not torch.equal(weights(fresh, checkpoint.tag_for(1))["lm_head.weight"], theirs["lm_head.weight"])


@pytest.mark.timeout(900)
def test_a_restart_resumes_its_own_checkpoints_without_the_source(train_env, tmp_path):
    source = run_train(tmp_path / "source", 1, "train.steps=2")
    start = run_train(tmp_path / "finetune", 1, "train.steps=1", f"model.init_from_checkpoint={source}")
    source.rename(tmp_path / "gone")  # the source is not read again
    resumed = run_train(tmp_path / "finetune", 1, "train.steps=2", f"model.init_from_checkpoint={source}")
    assert resumed == start and [r["step"] for r in trail(resumed)] == [1, 2]
    assert len([e for e in read_metrics(resumed) if e.get("event") == "finetune"]) == 1
