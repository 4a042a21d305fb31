"""Exact resume (fp32): 2N steps in one go vs N steps, stop, resume from ``latest``, N more.

Both runs use the same LR schedule (``optim.decay_steps=2N``), so stopping at N changes nothing but the process
boundary. The trails must be identical: loss, z-loss, lr, grad norm and consumed samples per step, compared with
``==`` (no tolerance: the same layout on the same machine is deterministic), and so must the final weights.
"""

from __future__ import annotations

import pytest
import torch

from llmjp_ds import checkpoint

from tests.runs import N, STEPS, read_json, trail

pytestmark = pytest.mark.slow

COMPARED = ("loss", "z_loss", "lr", "grad_norm", "consumed_samples")


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    tag = checkpoint.latest_tag(run_dir)
    return checkpoint.read_model_state(run_dir, tag, checkpoint.read_marker(run_dir, tag))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["single", "zero2", "pp2"])
def test_exact_resume(layout, runs):
    full, resumed = runs.full(layout), runs.resumed(layout)
    a, b = trail(full), trail(resumed)
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), "the resumed trail must hold each step once"
    for key in COMPARED:
        assert [r[key] for r in b] == [r[key] for r in a], f"{layout}: {key} differs after resuming at step {N}"

    from llmjp_ds.metrics.record import read_metrics

    events = [r for r in read_metrics(resumed) if r.get("event") == "resume"]
    assert [(e["step"], e["tag"]) for e in events] == [(N, checkpoint.tag_for(N))]
    assert not [r for r in read_metrics(full) if r.get("event") == "resume"]

    ckpts = checkpoint.checkpoint_dir(resumed)
    latest = (ckpts / "latest").read_text().strip()
    assert latest == checkpoint.tag_for(STEPS)
    marker = read_json(ckpts / latest / checkpoint.MARKER)
    assert marker["step"] == STEPS and marker["tag"] == latest
    assert (ckpts / checkpoint.tag_for(N) / checkpoint.MARKER).is_file()  # the stop's save, kept (keep_last=2)

    wa, wb = _final_weights(full), _final_weights(resumed)
    assert sorted(wa) == sorted(wb)
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{layout}: final weights differ after resuming: {different[:5]}"
