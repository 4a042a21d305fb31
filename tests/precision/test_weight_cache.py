"""``ReusesFP8Weights``: the ``is_first_microbatch`` flag TE modules receive, driven by their ``WeightCache``; and
``PrecisionSchedule`` owning the cache, attaching it to TE modules only for real TE FP8, and bumping it."""

from __future__ import annotations

import pytest

from llmjp_ds.model.weight_reuse import ReusesFP8Weights
from llmjp_ds.precision.weight_cache import WeightCache


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


def cached(cache: WeightCache | None = None) -> M:
    m = M()
    m.weight_cache = cache or WeightCache()
    return m


def test_without_a_cache_the_flag_is_never_set():
    m = M()
    for _ in range(3):
        m.forward("x")
    assert flags(m) == [None] * 3


def test_first_forward_after_a_change_casts_the_rest_reuse():
    cache = WeightCache()
    m = cached(cache)
    for _ in range(4):  # micro-batches of one step (and recomputes): one cast, then reuse
        assert m.forward("x") == "x"
    assert flags(m) == [True, False, False, False]
    cache.weights_changed()  # optimizer step
    m.forward("x")
    m.forward("x")
    cache.weights_changed()
    cache.weights_changed()  # two changes without a forward between: still one cast
    m.forward("x")
    m.forward("x")
    assert flags(m) == [True, False, False, False, True, False, True, False]


def test_inputs_and_other_arguments_pass_through():
    m = cached()
    m.forward("a", fp8_output=True)
    m.forward("b")
    assert m.calls == [("a", True, {"fp8_output": True}), ("b", False, {})]


@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_flag_passes_unchanged(explicit):
    m = cached()
    m.forward("x", is_first_microbatch=explicit)
    m.forward("x", explicit)  # positionally too
    assert flags(m) == [explicit, explicit]
    # the explicit calls did not consume the module's first-of-generation forward
    m.forward("x")
    assert flags(m)[-1] is True


def test_modules_track_the_generation_independently():
    cache = WeightCache()
    a, b = cached(cache), cached(cache)
    a.forward("x")
    a.forward("x")
    b.forward("x")  # b's first forward of this generation, although a already cast its weights
    cache.weights_changed()
    b.forward("x")
    b.forward("x")
    a.forward("x")
    assert flags(a) == [True, False, True]
    assert flags(b) == [True, True, False]


def test_two_caches_are_independent():
    one, two = WeightCache(), WeightCache()
    a, b = cached(one), cached(two)
    a.forward("x")
    b.forward("x")
    one.weights_changed()
    a.forward("x")
    b.forward("x")
    assert flags(a) == [True, True] and flags(b) == [True, False]


# --- the precision schedule owns and attaches the cache -----------------------------------------------------

FP8 = "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 2, recipe: current}]"


def schedule_for(backend: str, *sets: str):
    from llmjp_ds.config import load_config
    from llmjp_ds.precision.schedule import PrecisionSchedule

    cfg = load_config(None, list(sets), "demo")
    return PrecisionSchedule(cfg.precision, backend, 8 * 128)


class Model:
    """Stands in for a model: its modules, one of them a TE GEMM module."""

    def __init__(self):
        self.gemm = M()

    def modules(self):
        return [self, self.gemm]


@pytest.mark.parametrize("sets", [(), (FP8, "precision.emulate_fp8=true")], ids=["bf16", "emulated-fp8"])
def test_schedule_attaches_no_cache_on_the_torch_backend(sets):
    schedule, model = schedule_for("torch", *sets), Model()
    schedule.attach(model, [], num_layers=4)
    assert model.gemm.weight_cache is None


@pytest.mark.parametrize("sets,enabled", [((FP8,), True), ((FP8, "precision.fp8_weight_cache=false"), False),
                                          ((), False)], ids=["fp8", "fp8-cache-off", "bf16"])
def test_schedule_attaches_the_cache_for_real_te_fp8_only(monkeypatch, sets, enabled):
    import llmjp_ds.precision.schedule as precision

    monkeypatch.setattr(precision, "fp8_hardware_available", lambda: True)  # as on an H200 with TE
    schedule, model = schedule_for("te", *sets), Model()
    schedule.attach(model, [], num_layers=4)
    assert (model.gemm.weight_cache is schedule.weight_cache) is enabled


def test_end_step_and_loads_advance_the_generation_by_one():
    schedule = schedule_for("torch")
    g = schedule.weight_cache.generation
    schedule.end_step()
    assert schedule.weight_cache.generation == g + 1
    schedule.end_step()
    assert schedule.weight_cache.generation == g + 2
    schedule.weights_changed()  # after a checkpoint load
    assert schedule.weight_cache.generation == g + 3


def test_end_step_makes_the_next_forward_cast_again():
    schedule = schedule_for("torch")
    m = cached(schedule.weight_cache)
    m.forward("x")
    m.forward("x")
    schedule.end_step()
    m.forward("x")
    assert flags(m) == [True, False, True]
