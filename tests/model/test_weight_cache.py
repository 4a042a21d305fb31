"""``ReusesFP8Weights``: the ``is_first_microbatch`` flag TE modules receive, driven by ``weights_changed()``; and
``PrecisionSchedule`` switching the cache and bumping its generation."""

from __future__ import annotations

import pytest

from llmjp_ds.model import weight_cache
from llmjp_ds.model.weight_cache import WEIGHT_CACHE, ReusesFP8Weights, weights_changed


class Base:
    """Stands in for a TE module: records what its forward was told."""

    def __init__(self):
        self.calls = []

    def forward(self, inp, is_first_microbatch=None, **kwargs):
        self.calls.append((inp, is_first_microbatch, kwargs))
        return inp


class M(ReusesFP8Weights, Base):
    pass


def flags(module: M) -> list:
    return [call[1] for call in module.calls]


@pytest.fixture(autouse=True)
def cache_state():
    saved = (WEIGHT_CACHE.enabled, WEIGHT_CACHE.generation)
    yield
    WEIGHT_CACHE.enabled, WEIGHT_CACHE.generation = saved


def test_disabled_never_sets_the_flag():
    WEIGHT_CACHE.enabled = False
    m = M()
    for _ in range(3):
        m.forward("x")
    weights_changed()
    m.forward("x")
    assert flags(m) == [None] * 4


def test_enabled_first_forward_after_a_change_casts_the_rest_reuse():
    WEIGHT_CACHE.enabled = True
    m = M()
    for _ in range(4):  # micro-batches of one step (and recomputes): one cast, then reuse
        assert m.forward("x") == "x"
    assert flags(m) == [True, False, False, False]
    weights_changed()  # optimizer step
    m.forward("x")
    m.forward("x")
    weights_changed()
    weights_changed()  # two changes without a forward between: still one cast
    m.forward("x")
    m.forward("x")
    assert flags(m) == [True, False, False, False, True, False, True, False]


def test_inputs_and_other_arguments_pass_through():
    WEIGHT_CACHE.enabled = True
    m = M()
    m.forward("a", fp8_output=True)
    m.forward("b")
    assert m.calls == [("a", True, {"fp8_output": True}), ("b", False, {})]


@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_flag_passes_unchanged(explicit):
    WEIGHT_CACHE.enabled = True
    m = M()
    m.forward("x", is_first_microbatch=explicit)
    m.forward("x", explicit)  # positionally too
    assert flags(m) == [explicit, explicit]
    # the explicit calls did not consume the module's first-of-generation forward
    m.forward("x")
    assert flags(m)[-1] is True


def test_modules_track_the_generation_independently():
    WEIGHT_CACHE.enabled = True
    a, b = M(), M()
    a.forward("x")
    a.forward("x")
    b.forward("x")  # b's first forward of this generation, although a already cast its weights
    weights_changed()
    b.forward("x")
    b.forward("x")
    a.forward("x")
    assert flags(a) == [True, False, True]
    assert flags(b) == [True, True, False]


def test_enabling_later_starts_with_a_cast():
    m = M()
    WEIGHT_CACHE.enabled = False
    m.forward("x")
    WEIGHT_CACHE.enabled = True
    m.forward("x")
    m.forward("x")
    assert flags(m) == [None, True, False]


def test_weights_changed_advances_the_generation():
    g = WEIGHT_CACHE.generation
    weights_changed()
    assert WEIGHT_CACHE.generation == g + 1
    assert weight_cache.WEIGHT_CACHE is WEIGHT_CACHE


# --- the precision schedule drives the cache ---------------------------------------------------------------

FP8 = "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 2, recipe: current}]"


def schedule_for(backend: str, *sets: str):
    from llmjp_ds.config import load_config
    from llmjp_ds.precision import PrecisionSchedule

    cfg = load_config(None, list(sets), "demo")
    return PrecisionSchedule(cfg.precision, backend, 8 * 128)


@pytest.mark.parametrize("sets", [(), (FP8, "precision.emulate_fp8=true")], ids=["bf16", "emulated-fp8"])
def test_schedule_leaves_the_cache_off_on_the_torch_backend(sets):
    WEIGHT_CACHE.enabled = True  # whatever an earlier run left
    schedule_for("torch", *sets)
    assert WEIGHT_CACHE.enabled is False


@pytest.mark.parametrize("sets,enabled", [((FP8,), True), ((FP8, "precision.fp8_weight_cache=false"), False),
                                          ((), False)], ids=["fp8", "fp8-cache-off", "bf16"])
def test_schedule_enables_the_cache_for_real_te_fp8_only(monkeypatch, sets, enabled):
    import llmjp_ds.precision as precision

    monkeypatch.setattr(precision, "fp8_hardware_available", lambda: True)  # as on an H200 with TE
    WEIGHT_CACHE.enabled = not enabled
    schedule_for("te", *sets)
    assert WEIGHT_CACHE.enabled is enabled


def test_end_step_advances_the_generation_by_one():
    schedule = schedule_for("torch")
    g = WEIGHT_CACHE.generation
    schedule.end_step()
    assert WEIGHT_CACHE.generation == g + 1
    schedule.end_step()
    assert WEIGHT_CACHE.generation == g + 2
    schedule.weights_changed()  # after a checkpoint load
    assert WEIGHT_CACHE.generation == g + 3


def test_end_step_makes_the_next_forward_cast_again():
    schedule = schedule_for("torch")
    WEIGHT_CACHE.enabled = True
    m = M()
    m.forward("x")
    m.forward("x")
    schedule.end_step()
    m.forward("x")
    assert flags(m) == [True, False, True]
