"""What watches FP8 once it runs (``precision/guards.py``): the divergence guard."""

from __future__ import annotations

from llmjp_ds.config import GuardConfig
from llmjp_ds.precision.guards import DivergenceGuard


def test_guard_rolls_back_on_nan_at_once_and_on_spikes_after_patience():
    guard = DivergenceGuard(GuardConfig(window=4, factor=1.5, patience=2))
    for i, loss in enumerate([3.0, 3.0, 3.0, 3.0]):
        assert not guard.observe(i, loss, "bf16")
    assert not guard.observe(4, 3.2, "fp8")
    assert not guard.observe(5, 5.0, "fp8")  # first spike: wait for patience
    assert guard.observe(6, 5.0, "fp8") and guard.first_bad_step == 5
    guard.load_state_dict(guard.state_dict())
    assert guard.observe(7, float("nan"), "fp8")
    assert not DivergenceGuard(GuardConfig(enabled=False)).observe(0, float("nan"), "fp8")
