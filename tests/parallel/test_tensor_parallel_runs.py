"""Tensor parallelism (with sequence parallelism, the default) on CPU over gloo, against one process.

TP2, TP2 x PP2 and TP2 x DP2 (ZeRO-1) train the tiny fp32 model of ``tests/runs.py`` with the same seed, data and
global batch as the one-process run; ``test_equivalence`` compares their trails. Every TP size starts from the
same weights (each layer is built whole from its seed and split, ``hf_adapter.tp_shard``), so the trails differ
only by the order of fp32 sums: the split GEMMs' partial sums, the vocabulary-parallel log-sum-exp.

What the comparisons catch (there and here):

* the grad norm counts every parameter once: the sharded ones on every TP rank, the replicated RMSNorm weights
  once (DeepSpeed's ``tensor_model_parallel`` attribute). Counting the norms twice, or the shards once, moves
  it by far more than ``GRAD_NORM_RTOL``;
* sequence parallelism: each rank's RMSNorm sees its sequence shard only, so its weight gradient is partial
  until it is summed over the TP group; without that sum the norm weights train on half the tokens, the TP
  ranks' copies drift apart, and the loss leaves the one-process trail;
* the export of the TP2 x PP2 checkpoint merges the shards (``layer_XX-model_YY``) into one HF checkpoint: its
  logits must be the one-process export's (``test_export``'s tolerance);
* the emulated BF16 -> FP8 flip at TP2: the TP ranks reduce their amax over the stage's TP x DP group, so both
  ranks quantise with the scales the one-process run uses (the same amax of the whole tensor): the first FP8
  step's loss is the one-process run's, and the ranks' amax histories, saved in their own checkpoint files,
  are identical. FP8 rounding turns TP's reordered fp32 sums into small trail differences after that
  (``FP8_RTOL``). A resume after the flip repeats the uninterrupted TP2 run exactly.
"""

from __future__ import annotations

import pytest
import torch

from llmjp_ds import checkpoint

from tests.runs import BF16_STEPS, FLIP, FLIP_AT, N, STEPS, max_rel_diff, run_train, trail
from tests.train.test_export import LOGITS_RTOL, _probe_logits

pytestmark = pytest.mark.slow

TP2 = ("parallel.tensor_parallel=2",)
FIRST_FP8_RTOL = 1e-6
FP8_RTOL = 1e-4


@pytest.mark.timeout(900)
def test_tp2_pp2_checkpoint_holds_a_shard_per_rank_and_exports_like_one_process(runs, exports):
    run_dir = runs.full("tp2-pp2")
    tag = checkpoint.latest_tag(run_dir)
    files = sorted(p.name for p in (checkpoint.checkpoint_dir(run_dir) / tag).glob("layer_*-model_states.pt"))
    assert files == [f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in range(4) for r in range(2)]
    assert checkpoint.read_marker(run_dir, tag).tensor_parallel == 2
    out, stdout = exports("tp2-pp2")
    assert "AutoModelForCausalLM reload check passed" in stdout, stdout
    ref, got = _probe_logits(exports("single")[0]), _probe_logits(out)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"\ntp2-pp2: exported logits vs 1-process export: max |d| / max |logit| = {rel:.2e}")
    assert rel <= LOGITS_RTOL


@pytest.fixture(scope="module")
def tp_flip_runs(train_env, tmp_path_factory):
    """The emulated flip at step ``FLIP_AT``: one process, TP2, and TP2 stopped at ``N`` and resumed."""
    root = tmp_path_factory.mktemp("tp-flip")
    single = run_train(root / "single", 1, *FLIP, f"train.steps={STEPS}")
    tp2 = run_train(root / "tp2", 2, *TP2, *FLIP, f"train.steps={STEPS}")
    run_train(root / "tp2-resumed", 2, *TP2, *FLIP, f"train.steps={N}")
    resumed = run_train(root / "tp2-resumed", 2, *TP2, *FLIP, f"train.steps={STEPS}")
    return single, tp2, resumed


@pytest.mark.timeout(900)
def test_flip_at_tp2_follows_one_process_and_shares_scales(tp_flip_runs, runs):
    single, tp2, _ = tp_flip_runs
    ref, got = trail(single), trail(tp2)
    base = [r["loss"] for r in trail(runs.full("single"))]  # the same run without the flip
    assert [r["precision"] for r in got] == [r["precision"] for r in ref] == \
        ["fp32"] * BF16_STEPS + ["fp8"] * (STEPS - BF16_STEPS)
    ours, theirs = [r["loss"] for r in got], [r["loss"] for r in ref]
    # through the first FP8 step (calibrated scales, the same weights): TP2 computes what one process does,
    # while FP8 already moved that step's loss (measured 3.5e-6; TP2 vs one process: 0)
    first = FLIP_AT  # the records up to the first FP8 step's
    assert max_rel_diff(ours[:first], theirs[:first]) <= FIRST_FP8_RTOL
    assert max_rel_diff(theirs[BF16_STEPS:first], base[BF16_STEPS:first]) > FIRST_FP8_RTOL
    # after FP8 updates, a sum taken in another order (TP's partial GEMMs) lands on the other side of an FP8
    # rounding boundary now and then, so the trails part by more than fp32 noise (measured 2.7e-5)
    later = max_rel_diff(ours, theirs)
    print(f"\nTP2 flip vs 1 process: max rel loss diff {later:.2e}")
    assert later <= FP8_RTOL
    tag_dir = checkpoint.checkpoint_dir(tp2) / checkpoint.latest_tag(tp2)
    ranks = [torch.load(tag_dir / f"mp_rank_{r:02d}_model_states.pt", map_location="cpu", weights_only=False)["module"]
             for r in range(2)]
    histories = [k for k, v in ranks[0].items() if k.endswith("_extra_state") and v.dtype == torch.float32
                 and v.numel()]
    assert len(histories) >= 4  # every decoder GEMM module keeps an amax history
    for key in histories:
        assert float(ranks[0][key].abs().max()) > 0, f"{key}: no amax recorded"
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key}: the TP ranks' amax histories differ"


@pytest.mark.timeout(900)
def test_resume_after_the_flip_at_tp2_is_exact(tp_flip_runs):
    _, tp2, resumed = tp_flip_runs
    a, b = trail(tp2), trail(resumed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for key in ("loss", "z_loss", "grad_norm", "lr", "precision"):
        assert [r[key] for r in b] == [r[key] for r in a], f"{key} differs after resuming at step {N}"
