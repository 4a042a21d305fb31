"""`llmjp-ds plot`: a PNG from a synthetic metrics trail, with phases and events actually drawn; clean failures."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import pytest

from llmjp_ds.errors import UserError
from llmjp_ds.metrics.logger import MetricsLogger
from llmjp_ds.metrics.plot import cli_main, plot_run

TAB_RED = (214, 39, 40)  # the rollback line
FP8_SHADE = (255, 240, 226)  # tab:orange (255, 127, 14) at alpha 0.12 over white


def _write_run(run_dir, *, flip_at=None, rollback_at=None, steps=120):
    with MetricsLogger(run_dir, wandb_mode="disabled") as logger:
        for step in range(1, steps + 1):
            fp8 = flip_at is not None and step >= flip_at
            logger.log(step, {
                "loss": 2.0 + 9.0 * math.exp(-step / 30), "z_loss": 1e-4 * (5 + math.sin(step)),
                "lr": 3e-4 * min(1.0, step / 10), "tokens_per_s": 2000.0,
                "tflops_per_gpu": 0.55 if fp8 else 0.40, "mfu": 0.5 if fp8 else 0.4,
                "phase": "fp8" if fp8 else "bf16"})
            if step % 30 == 0:
                logger.log(step, {"valid_loss": 2.1 + 9.0 * math.exp(-step / 30)})
            if step == rollback_at:
                logger.event(step, "rollback", to_step=step - 10)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _pixels_near(path, rgb, tol=4):
    import numpy as np
    from matplotlib.image import imread

    image = (imread(path)[..., :3] * 255).round().astype(int)
    return int((np.abs(image - np.array(rgb)).max(axis=-1) <= tol).sum())


def test_plot_draws_phases_and_events(tmp_path):
    run = tmp_path / "run"
    _write_run(run, flip_at=60, rollback_at=90)
    out = plot_run(run)
    assert out == run / "metrics.png"
    assert _png_size(out) == (1000, 900)  # three panels: loss, lr, TFLOP/s
    assert 20_000 < out.stat().st_size < 2_000_000
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "metrics.png"]  # no temp file left
    assert _pixels_near(out, TAB_RED) > 500  # a dashed line through three panels
    assert _pixels_near(out, FP8_SHADE) > 150_000  # half of every panel (~260k pixels)

    # The same run without the flip and the rollback: neither the shade nor the red line.
    plain = tmp_path / "plain"
    _write_run(plain)
    plot_run(plain)
    assert _pixels_near(plain / "metrics.png", TAB_RED) == 0
    assert _pixels_near(plain / "metrics.png", FP8_SHADE) < 1_000  # only the orange valid-loss line's edges


def test_plot_only_draws_panels_with_data(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled") as logger:
        for step in range(1, 20):
            logger.log(step, {"loss": 5.0 / step})
    assert _png_size(plot_run(tmp_path, tmp_path / "loss.png")) == (1000, 340)  # one panel: (2.8 + 0.6) in


def test_cli_writes_to_output(tmp_path, capsys):
    _write_run(tmp_path / "run", steps=10)
    assert cli_main([str(tmp_path / "run"), "--output", str(tmp_path / "x.png")], verb="plot") == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'x.png'}"
    assert _png_size(tmp_path / "x.png")[0] == 1000


def test_missing_run_dir_is_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llmjp_ds.cli", "plot", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"error: run directory {tmp_path / 'nope'} does not exist\n"


def test_run_dir_without_metrics_fails_cleanly(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl in"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "event": "resume"}\n')
    with pytest.raises(UserError, match="holds no step metrics"):
        plot_run(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        plot_run(tmp_path, tmp_path / "no" / "such" / "dir.png")


# --- an MoE run: its routers' losses and the load of each expert ---------------------------------------------------

M5 = [[4, 4, 4, 4], [1, 7, 4, 4], [8, 8, 0, 0]]
M10 = [[2, 6, 4, 0], [3, 3, 3, 3], [5, 5, 5, 1]]
M10_RESUMED = [[6, 2, 0, 4], [0, 0, 0, 0], [1, 5, 5, 5]]


def _write_moe_run(run_dir, steps=12):
    """Records as an MoE run's (metrics/experts.py): the matrix every 5 steps (3 MoE layers of 4 experts)."""
    with MetricsLogger(run_dir, wandb_mode="disabled") as logger:
        for step in range(1, steps + 1):
            logger.log(step, {"loss": 9.0 - 0.5 * step, "lr": 1e-3, "moe_aux_loss": 1.0 + 0.01 * step,
                              "moe_z_loss": 30.0 - step, **({"moe_expert_load": {5: M5, 10: M10}[step]}
                                                            if step in (5, 10) else {})})


def _heat_map(fig):
    (image,) = [im for ax in fig.axes for im in ax.images]
    return image


def _axis(fig, label):
    (ax,) = [ax for ax in fig.axes if ax.get_ylabel() == label]
    return ax


def test_an_moe_runs_plot_maps_its_last_expert_load_and_draws_its_router_losses(tmp_path):
    import numpy as np

    from llmjp_ds.metrics.plot import run_figure

    run = tmp_path / "moe"
    _write_moe_run(run)
    fig = run_figure(run)
    image = _heat_map(fig)
    # the last matrix (step 10's), each expert's tokens over its layer's mean; a layer of no token is 0
    np.testing.assert_allclose(image.get_array(), [[2 / 3, 2, 4 / 3, 0], [1, 1, 1, 1], [5 / 4, 5 / 4, 5 / 4, 1 / 4]])
    assert image.axes.get_title() == "expert load at step 10 (tokens / the layer's mean)"
    assert (image.axes.get_xlabel(), image.axes.get_ylabel()) == ("expert", "MoE layer")
    assert image.norm.vmin == 0.0 and image.norm.vmax == 2.0
    assert _axis(fig, "1 = an even share").get_label() == "<colorbar>"
    (aux,) = _axis(fig, "MoE router losses").get_lines()
    (z,) = _axis(fig, "router z-loss").get_lines()
    assert list(aux.get_xdata()) == list(range(1, 13)) == list(z.get_xdata())
    assert list(aux.get_ydata()) == [1.0 + 0.01 * s for s in range(1, 13)]
    assert list(z.get_ydata()) == [30.0 - s for s in range(1, 13)]
    assert [ax.get_ylabel() for ax in fig.axes][:3] == ["loss", "MoE router losses", "learning rate"]
    out = plot_run(run)
    assert _png_size(out) == (1000, 1180)  # three panels and the heat map: (4 x 2.8 + 0.6) in at 100 dpi

    # resumed from step 8: step 10's matrix is the new attempt's, the one the run went back over is not drawn;
    # a malformed matrix (ragged) at a later step is skipped as other unreadable values are
    with MetricsLogger(run, wandb_mode="disabled", step=8) as logger:
        for step in range(9, 13):
            logger.log(step, {"loss": 4.0, **({"moe_expert_load": M10_RESUMED} if step == 10 else {}),
                              **({"moe_expert_load": [[1, 2], [3]]} if step == 12 else {})})
    image = _heat_map(run_figure(run))
    np.testing.assert_allclose(image.get_array(), [[2, 2 / 3, 0, 4 / 3], [0, 0, 0, 0], [1 / 4, 5 / 4, 5 / 4, 5 / 4]])
    assert image.axes.get_title().startswith("expert load at step 10 ")


def test_a_dense_runs_plot_has_neither_heat_map_nor_router_panel(tmp_path):
    from llmjp_ds.metrics.plot import run_figure

    _write_run(tmp_path / "run", flip_at=60, rollback_at=90)
    fig = run_figure(tmp_path / "run")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "learning rate", "model TFLOP/s per GPU", "z-loss", "MFU"]
    assert not [im for ax in fig.axes for im in ax.images] and not fig.subfigs
    assert _png_size(plot_run(tmp_path / "run")) == (1000, 900)
