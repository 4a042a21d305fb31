"""Training curves of both stacks (`llmjp_ds/metrics/curves.py`) and `llmjp-ds plot --beside`: a Megatron-LM log read
step for step, a run's metrics, the gap between two curves, and the figure that draws them together."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmjp_ds.metrics.curves import gap, megatron_log_curve, read_curve, run_curve
from llmjp_ds.errors import UserError
from llmjp_ds.metrics.logger import MetricsLogger
from llmjp_ds.metrics.plot import _by_step, _draw, cli_main, read_records


def megatron_line(step: int, total: int, loss: float, grad_norm: float, lr: float) -> str:
    """One line of Megatron-LM's training log, field for field as ``training_log`` (megatron/training/training.py,
    Megatron-Core 0.19) formats it under ``--log-interval 1``."""
    return (f"[2026-12-03 10:00:00] iteration {step:8d}/{total:8d} | consumed samples: {step:12d} | elapsed time per "
            f"iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 450.1 | learning rate: {lr:.6E} | global "
            f"batch size: {1:5d} | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {grad_norm:.3f} | number of "
            f"skipped iterations: {0:3d} | number of nan iterations: {0:3d} |")


def validation_line(prefix: str, loss: float) -> str:
    return f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(loss):.6E} | "


def _loss(step: int, shift: float = 0.0) -> float:
    return 2.0 + 9.0 * math.exp(-step / 30) + shift


def _write_megatron_log(path, shift: float = 0.0, steps: int = 120) -> None:
    lines = ["using world size: 1, data-parallel size: 1", "  lr ............................ 0.0003"]
    for step in range(1, steps + 1):
        lines.append(megatron_line(step, steps, _loss(step, shift), 1.0 + step / 1000, 3e-4 * min(1, step / 10)))
        if step % 30 == 0:
            lines.append(validation_line(f"iteration {step}", _loss(step, shift + 0.1)))
    lines.append(validation_line(f"iteration {steps} on validation set", 99.0))  # further batches: not the curve's
    lines.append(validation_line(f"iteration {steps} on test set", 98.0))  # another split
    path.write_text("\n".join(lines) + "\n")


def _write_run(run_dir, steps: int = 120) -> None:
    with MetricsLogger(run_dir, wandb_mode="disabled") as logger:
        for step in range(1, steps + 1):
            logger.log(step, {"loss": _loss(step), "grad_norm": 1.0, "lr": 3e-4, "tokens_per_s": 100.0,
                              "phase": "bf16"})
            if step % 30 == 0:
                logger.log(step, {"valid_loss": _loss(step, 0.1)})
        logger.event(60, "resume", tag="step00000060")


def test_megatron_log_is_read_step_for_step(tmp_path):
    log = tmp_path / "megatron.log"
    _write_megatron_log(log)
    curve = read_curve(log)
    assert sorted(curve) == list(range(1, 121))
    # the rate Megatron logs at iteration 6 is the one iteration 7 steps with
    assert curve[7] == pytest.approx({"loss": _loss(7), "grad_norm": 1.007, "lr": 3e-4 * 0.6}, rel=1e-6)
    assert "lr" not in curve[1]
    assert curve[90]["valid_loss"] == pytest.approx(_loss(90, 0.1), rel=1e-6)
    assert curve[120]["valid_loss"] == pytest.approx(_loss(120, 0.1), rel=1e-6)  # not the end's or the test set's


def test_a_step_logged_again_after_a_restart_keeps_its_last_line():
    text = "\n".join([megatron_line(5, 10, 3.0, 1.0, 1e-4), megatron_line(5, 10, 2.5, 0.5, 1e-4)])
    assert megatron_log_curve(text)[5]["loss"] == 2.5


def test_run_curve_skips_events_and_merges_a_step(tmp_path):
    _write_run(tmp_path)
    curve = read_curve(tmp_path)
    assert sorted(curve) == list(range(1, 121))
    assert curve[60] == pytest.approx({"loss": _loss(60), "grad_norm": 1.0, "lr": 3e-4, "valid_loss": _loss(60, 0.1)})
    assert run_curve([{"step": 3, "event": "resume"}]) == {}


def test_gap_over_the_last_common_steps():
    ref = {s: {"loss": 2.0} for s in range(1, 201)}
    other = {s: {"loss": 2.0 + (0.02 if s > 150 else 0.5)} for s in range(51, 201)}
    g = gap(ref, other, last=50)
    assert (g["steps"], g["first"], g["last"]) == (50, 151, 200)
    assert g["mean_abs"] == pytest.approx(0.02) and g["mean_rel"] == pytest.approx(0.01)
    assert g["final_rel"] == pytest.approx(0.01)
    assert gap(ref, other, last=100)["mean_abs"] == pytest.approx((50 * 0.02 + 50 * 0.5) / 100)
    assert gap(ref, {300: {"loss": 1.0}}) == {}
    # the last 10 steps' means: ours 2.02 on each, then ours 0.1 over on one of them alone
    assert g["tail_rel"] == pytest.approx(0.01)
    other[195]["loss"] += 0.1
    assert gap(ref, other)["tail_rel"] == pytest.approx((10 * 0.02 + 0.1) / (10 * 2.0))
    assert gap(ref, other)["final_rel"] == pytest.approx(0.01)


def test_a_source_without_a_loss_is_one_line(tmp_path):
    log = tmp_path / "other.log"
    log.write_text("using world size: 1\n")
    with pytest.raises(UserError, match="holds no training loss.*--log-interval 1"):
        read_curve(log)


def test_plot_beside_draws_the_other_curves_and_the_differences(tmp_path, capsys):
    _write_run(tmp_path / "ours")
    _write_megatron_log(tmp_path / "megatron-a.log")
    _write_megatron_log(tmp_path / "megatron-b.log", shift=0.01)
    steps, events = _by_step(read_records(tmp_path / "ours" / "metrics.jsonl")[0])
    beside = [(name, read_curve(tmp_path / f"{name}.log")) for name in ("megatron-a", "megatron-b")]
    fig = _draw(steps, events, "t", beside=beside)
    labels = {ax.get_ylabel(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes}
    assert {"megatron-a", "megatron-b", "megatron-a valid"} <= set(labels["loss"])
    assert {"megatron-a", "megatron-b"} <= set(labels["grad norm"])
    delta = next(ax for ax in fig.axes if ax.get_ylabel() == "loss - megatron-a")
    lines = {line.get_label(): line.get_ydata() for line in delta.get_lines() if not line.get_label().startswith("_")}
    assert max(abs(y) for y in lines["this run - megatron-a"]) < 1e-5  # the log's 7 digits
    assert all(y == pytest.approx(0.01, abs=1e-5) for y in lines["megatron-b - megatron-a"])

    assert cli_main([str(tmp_path / "ours"), "--output", str(tmp_path / "out.png"), "--beside",
                     str(tmp_path / "megatron-a.log"), "--beside", str(tmp_path / "megatron-b.log")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    assert out[1].startswith("ours - megatron-a: mean |loss difference| ") and "over steps 21-120" in out[1]
    assert out[2].startswith("megatron-b - megatron-a: mean |loss difference| 0.01 ")


def test_a_log_megatron_lm_wrote_reads_as_its_lines_say():
    """Lines Megatron-LM core_v0.19's pretrain_gpt.py printed on the H200 (run AD's run B, docs/performance.md)."""
    curve = read_curve(Path(__file__).parent / "fixtures" / "megatron" / "pretrain_gpt-0.19.log")
    assert sorted(curve) == [1, 2, 3, 4, 99, 100]  # 4: the rate line 3 gives it; none past the last loss
    assert curve[1] == {"loss": 11.91296, "grad_norm": 80.123}  # its rate is iteration 2's
    assert curve[2] == {"loss": 11.92958, "grad_norm": 45.857, "lr": 6e-06}
    assert curve[100]["valid_loss"] == 6.376589


def test_a_megatron_processs_second_line_is_taken_apart_from_its_first():
    """Megatron-Core 0.19 prints on a process's second line the mean of its first two losses. Measured on the H200
    (docs/performance.md, run AE): from one checkpoint at 250 on one batch each step, Megatron-LM printed
    4.88904 / 5.17945 / 5.88216 at 251-253 and ours logged 4.88902 / 5.46996 / 5.88224, the grad norms equal at
    every step; and run AD's run B (the fixture) printed 11.92958 at step 2, where ours logged 11.94641."""
    from llmjp_ds.metrics.curves import megatron_unmixed

    restart = {250: {"loss": 4.88061}, 251: {"loss": 4.88904}, 252: {"loss": 5.17945, "grad_norm": 3.140},
               253: {"loss": 5.88216}}
    unmixed = megatron_unmixed(restart, [1, 251])
    assert unmixed[252]["loss"] == pytest.approx(5.46996, abs=2e-4) and unmixed[252]["grad_norm"] == 3.140
    assert {s: unmixed[s] for s in (250, 251, 253)} == {s: restart[s] for s in (250, 251, 253)}
    assert restart[252]["loss"] == 5.17945  # the curve given is left as it was
    fixture = read_curve(Path(__file__).parent / "fixtures" / "megatron" / "pretrain_gpt-0.19.log")
    assert megatron_unmixed(fixture, [1])[2]["loss"] == pytest.approx(11.94641, abs=2e-3)
    assert megatron_unmixed(fixture, [1])[3] == fixture[3]


def moe_line(step: int, loss: float, aux: float, z: float) -> str:
    """A line of an MoE run: ``training_log`` prints the router's losses from its ``total_loss_dict`` after ``lm
    loss``, as it prints every loss (Megatron-Core 0.19's MoEMetricsTracker.report puts them there)."""
    return (f" [2026-12-03 10:00:00] iteration {step:8d}/{300:8d} | consumed samples: {4 * step:12d} | learning rate: "
            f"3.000000E-04 | global batch size:     4 | lm loss: {loss:.6E} | load_balancing_loss: {aux:.6E} | "
            f"z_loss: {z:.6E} | loss scale: 1.0 | grad norm: 0.500 | number of skipped iterations:   0 |")


def test_an_moe_runs_router_losses_are_read_from_both_stacks(tmp_path):
    """Megatron's ``load_balancing_loss`` and ``z_loss`` are ours' ``moe_aux_loss`` and ``moe_z_loss``; a process's
    second line holds the mean of its first two of each, as of the LM loss."""
    from llmjp_ds.metrics.curves import megatron_unmixed

    text = "\n".join(moe_line(s, 5.0 - s / 100, 1.0 + s / 1000, 2.0 + s / 100) for s in (150, 151))
    text += "\n" + moe_line(152, (3.49 + 3.48) / 2, (1.151 + 1.152) / 2, (3.51 + 3.52) / 2)
    curve = megatron_log_curve(text)
    assert curve[150] == pytest.approx({"loss": 3.5, "moe_aux_loss": 1.15, "moe_z_loss": 3.5, "grad_norm": 0.5},
                                       rel=1e-6)
    unmixed = megatron_unmixed(curve, [151])
    assert unmixed[152] == pytest.approx({"loss": 3.48, "moe_aux_loss": 1.152, "moe_z_loss": 3.52,
                                          "grad_norm": 0.5, "lr": 3e-4}, rel=1e-6)
    assert unmixed[151] == curve[151] and curve[152]["moe_aux_loss"] == pytest.approx(1.1515, rel=1e-6)
    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        logger.log(1, {"loss": 11.5, "moe_aux_loss": 1.25, "moe_z_loss": 4.0, "moe_expert_load": [[1, 2], [3, 0]],
                       "moe_layer_imbalance": [1.3, 2.0]})
    assert read_curve(tmp_path) == {1: {"loss": 11.5, "moe_aux_loss": 1.25, "moe_z_loss": 4.0}}
