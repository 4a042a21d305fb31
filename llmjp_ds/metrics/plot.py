"""``llmjp-ds plot RUN_DIR``: loss, learning rate and throughput of a run against step, from its metrics.jsonl.

An MoE run's records add a panel of its routers' losses (``moe_aux_loss``, and ``moe_z_loss`` on a second axis)
below the loss, and a heat map of its last recorded ``moe_expert_load`` matrix (MoE layer x expert, each expert's
tokens over its layer's mean: 1 is an even share, 0 an expert that got none) under the curves.

Precision phases (the ``phase`` metric, e.g. BF16 then FP8) are shaded and their changes marked; events
(``rollback``, ``resume`` ...) are vertical lines. Drawn with matplotlib's Agg canvas (no display, no pyplot
state) and written atomically, so a plot refreshed while the run is going never shows a half-written PNG.

The metrics file is read leniently: a line torn by a kill, bytes that are not UTF-8, a record that is not an object
with an integer step, a value that is not a finite number are each skipped, and the plot is drawn from what is
left; only when nothing usable is left does ``plot`` stop, with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

from llmjp_ds.metrics.curves import gap, read_curve, run_curve
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import free_space, write_failure
from llmjp_ds.metrics.record import METRICS_FILE, changes, current_steps, parse_records

__all__ = ["plot_run", "run_figure", "last_expert_load", "load_shares", "cli_main"]

_PHASE_COLORS = ("tab:orange", "tab:green", "tab:purple", "tab:brown")
_EVENT_COLORS = {"rollback": "tab:red", "resume": "tab:gray", "precision_flip": "tab:orange"}


_LARGEST = 1e30  # beyond any loss, lr or throughput; matplotlib's axis arithmetic overflows near 1e308


def _numeric(value) -> bool:
    # inf would make matplotlib refuse the axis limits; NaN draws nothing anyway
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        abs(value) <= _LARGEST


def read_records(path: Path) -> tuple[list[dict], int]:
    """(the usable records of a metrics.jsonl in file order, how many non-blank lines were skipped): what
    ``metrics.parse_records`` reads, less steps a float axis cannot hold and events that are not names."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path} ({exc.strerror}): check its permissions and the disk")
    parsed, skipped = parse_records(data)
    records = []
    for record in parsed:
        if abs(record["step"]) >= 2**53 or ("event" in record and not isinstance(record["event"], str)):
            skipped += 1
            continue
        if "phase" in record and not isinstance(record["phase"], str):
            record.pop("phase")
        records.append(record)
    return records, skipped


def _by_step(records: list[dict]) -> tuple[dict[int, dict], list[dict]]:
    """Each step's current record (a step that a resume or a rollback went back over: its last attempt's), and
    every event in file order."""
    return current_steps(records), [r for r in records if "event" in r]


def _series(steps: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(step, r[key]) for step, r in steps.items() if _numeric(r.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _phase_spans(steps: dict[int, dict]) -> list[tuple[str, int, int]]:
    """Contiguous (phase, first step, step where the next phase starts or the last step)."""
    spans: list[list] = []
    for step, record in steps.items():
        phase = record.get("phase")
        if not isinstance(phase, str):
            continue
        if spans and spans[-1][0] == phase:
            spans[-1][2] = step
        else:
            if spans:
                spans[-1][2] = step
            spans.append([phase, step, step])
    return [tuple(s) for s in spans]


def _beside_lines(steps: dict[int, dict], beside: list[tuple[str, dict]]) -> dict[str, list]:
    """The lines other runs add, by panel: their loss (and validation loss) and grad norm, and each curve's loss
    minus the first other curve's (the reference), at the steps both logged."""
    lines: dict[str, list] = {"loss": [], "grad norm": [], "delta": []}
    if not beside:
        return lines
    ours = ("this run", run_curve([dict(r, step=s) for s, r in steps.items()]))
    for label, curve in beside:
        for key, name, style in (("loss", "loss", "-"), ("valid_loss", "loss", "o-"), ("grad_norm", "grad norm", "-")):
            xs, ys = _series(curve, key)
            if xs:
                suffix = " valid" if key == "valid_loss" else ""
                lines[name].append((xs, ys, f"{label}{suffix}", style))
    ref_label, ref = beside[0]
    for label, curve in [ours, *beside[1:]]:
        common = [s for s in curve if "loss" in curve[s] and "loss" in ref.get(s, {})]
        if common:
            lines["delta"].append((common, [curve[s]["loss"] - ref[s]["loss"] for s in common],
                                   f"{label} - {ref_label}", "-"))
    return lines


def _panels(steps: dict[int, dict], beside: list, extra: dict, where: str) -> list:
    """(title, [(key, label, style)], twin (key, label) or None) of each panel with something to draw."""
    panels = []
    if _series(steps, "loss")[0] or _series(steps, "valid_loss")[0]:
        panels.append(("loss", [("loss", "train loss", "-"), ("valid_loss", "valid loss", "o-")],
                       ("z_loss", "z-loss")))
    if _series(steps, "moe_aux_loss")[0] or _series(steps, "moe_z_loss")[0]:
        panels.append(("MoE router losses", [("moe_aux_loss", "load-balancing loss", "-")],
                       ("moe_z_loss", "router z-loss")))
    if _series(steps, "fp8_penalty")[0]:
        panels.append(("FP8 penalty", [("fp8_penalty", "valid loss FP8 / BF16 - 1", "o-")], None))
    if _series(steps, "lr")[0]:
        panels.append(("learning rate", [("lr", "lr", "-")], None))
    if _series(steps, "tflops_per_gpu")[0]:
        panels.append(("model TFLOP/s per GPU", [("tflops_per_gpu", "TFLOP/s per GPU", "-")], ("mfu", "MFU")))
    elif _series(steps, "tokens_per_s")[0]:
        panels.append(("tokens/s", [("tokens_per_s", "tokens/s", "-")], None))
    if not panels:
        fail(f"{where} holds no loss, lr or throughput to plot: nothing to draw yet")
    if extra["grad norm"]:
        panels.insert(1, ("grad norm", [("grad_norm", "grad norm", "-")], None))
    if extra["delta"]:
        panels.insert(2, (f"loss - {beside[0][0]}", [], None))
    return panels


def _draw(steps: dict[int, dict], events: list[dict], title: str, where: str = "the metrics",
          beside: list[tuple[str, dict]] = ()):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    extra = _beside_lines(steps, list(beside))
    panels = _panels(steps, list(beside), extra, where)
    load = last_expert_load(steps)

    fig = Figure(figsize=(10, 2.8 * (len(panels) + (load is not None)) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    if load is None:
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    else:  # the heat map's x axis is the experts: a subfigure of its own below the curves that share the steps
        curves, heat = fig.subfigures(2, 1, height_ratios=[len(panels), 1])
        axes = curves.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        _draw_expert_load(heat, *load)
    fig.suptitle(title)

    spans = _phase_spans(steps)
    phase_color = {}
    for phase, *_ in spans[1:]:  # the first phase is the baseline, left unshaded
        if phase != spans[0][0] and phase not in phase_color:
            phase_color[phase] = _PHASE_COLORS[len(phase_color) % len(_PHASE_COLORS)]
    event_names = list(dict.fromkeys(e["event"] for e in events))
    extra_color = iter(["tab:pink", "tab:olive", "tab:cyan", "black"] * 8)
    event_color = {n: _EVENT_COLORS.get(n) or next(extra_color) for n in event_names}

    for ax, (name, lines, twin) in zip(axes, panels):
        for key, label, style in lines:
            xs, ys = _series(steps, key)
            if xs:
                ax.plot(xs, ys, style, label=label, markersize=3, linewidth=1.2)
        for xs, ys, label, style in extra.get("delta" if name.startswith("loss - ") else name, []):
            ax.plot(xs, ys, style, label=label, markersize=3, linewidth=1)
        if name.startswith("loss - "):
            ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if twin is not None:
            xs, ys = _series(steps, twin[0])
            if xs:
                ax2 = ax.twinx()
                ax2.plot(xs, ys, ":", color="tab:gray", alpha=0.7, label=twin[1], linewidth=1)
                ax2.set_ylabel(twin[1])
                h2, l2 = ax2.get_legend_handles_labels()
                handles, labels = handles + h2, labels + l2
        for phase, start, end in spans:
            if phase in phase_color:
                ax.axvspan(start, end, color=phase_color[phase], alpha=0.12, linewidth=0)
        for _, _, boundary in spans[:-1]:  # where the next phase starts
            ax.axvline(boundary, color="black", linestyle=":", linewidth=0.8)
        for event in events:
            ax.axvline(event["step"], color=event_color[event["event"]], linestyle="--", linewidth=1)
        if ax is axes[0]:
            handles += [Patch(color=c, alpha=0.3, label=f"{p} phase") for p, c in phase_color.items()]
            handles += [Patch(color=event_color[n], label=n) for n in event_names]
            labels = [h.get_label() for h in handles]
        ax.legend(handles, labels, loc="upper right", fontsize="small")

    top = axes[0]
    for (_, _, boundary), (phase, _, _) in zip(spans, spans[1:]):
        top.annotate(f"→ {phase}", (boundary, 1), xycoords=("data", "axes fraction"), xytext=(2, -2),
                     textcoords="offset points", va="top", fontsize="small")
    for event in events:
        top.annotate(event["event"], (event["step"], 0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                     textcoords="offset points", rotation=90, fontsize="x-small",
                     color=event_color[event["event"]])
    axes[-1].set_xlabel("step")
    return fig


def last_expert_load(steps: dict[int, dict]) -> tuple[int, list[list[float]]] | None:
    """(step, matrix) of the last step whose current record holds a whole ``moe_expert_load`` (rows of equal
    length, non-negative finite counts), or None (a dense run's; a malformed matrix is skipped as other values
    are)."""
    for step in sorted(steps, reverse=True):
        matrix = steps[step].get("moe_expert_load")
        if (isinstance(matrix, list) and matrix and all(isinstance(row, list) and row for row in matrix)
                and len({len(row) for row in matrix}) == 1
                and all(_numeric(n) and n >= 0 for row in matrix for n in row)):
            return step, matrix
    return None


def load_shares(matrix: list[list[float]]) -> list[list[float]]:
    """Each expert's tokens over its layer's mean (1: an even share); a layer that routed no token is all 0."""
    out = []
    for row in matrix:
        mean = sum(row) / len(row)
        out.append([n / mean if mean else 0.0 for n in row])
    return out


def _draw_expert_load(subfig, step: int, matrix: list[list[float]]) -> None:
    """The heat map of ``matrix`` (MoE layer x expert) as :func:`load_shares`, with its colorbar, in ``subfig``."""
    from matplotlib.ticker import MaxNLocator

    ax = subfig.subplots()
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))  # experts and layers are whole numbers
    image = ax.imshow(load_shares(matrix), aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0)
    ax.set_title(f"expert load at step {step} (tokens / the layer's mean)", fontsize="medium")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    subfig.colorbar(image, ax=ax, label="1 = an even share")


def _metrics_of(run_dir: Path) -> Path:
    """``<run_dir>/metrics.jsonl``, or one line saying why there is none."""
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"run directory {run_dir} is a file: pass the run_dir of a training run (it holds {METRICS_FILE})")
    if not run_dir.is_dir():
        fail(f"run directory {run_dir} does not exist")  # the path is the whole story
    metrics = run_dir / METRICS_FILE
    if metrics.is_dir() or not metrics.exists():
        fail(f"no {METRICS_FILE} in {run_dir}: has the run logged a step yet?")
    return metrics


def run_figure(run_dir: str | os.PathLike, beside=(), events=None):
    """The matplotlib ``Figure`` of ``<run_dir>/metrics.jsonl`` that :func:`plot_run` writes (its arguments)."""
    run_dir = Path(run_dir)
    metrics = _metrics_of(run_dir)
    records, skipped = read_records(metrics)
    steps, marked = _by_step(records)
    marked = [e for e in marked + changes(steps) if events is None or e["event"] in events]
    unreadable = f" ({skipped} unreadable lines skipped: torn, not UTF-8 or not JSON records)" if skipped else ""
    if not steps:
        fail(f"{metrics} holds no step metrics{unreadable or ' yet'}: nothing to plot")

    if skipped:
        print(f"plot: {metrics}: skipped {skipped} unreadable lines (torn, not UTF-8 or not JSON records)",
              file=sys.stderr)
    last = max(steps)
    others = [source if isinstance(source, tuple) else (_label(source), read_curve(source)) for source in beside]
    return _draw(steps, marked, title=f"{run_dir.resolve().name}  (step {last})", where=f"{metrics}{unreadable}",
                 beside=others)


def plot_run(run_dir: str | os.PathLike, output: str | os.PathLike | None = None, beside=(), events=None,
             option: str = "--output") -> Path:
    """Draw ``<run_dir>/metrics.jsonl`` to ``output`` (default ``<run_dir>/metrics.png``); return its path.
    ``beside``: other runs' directories or Megatron-LM logs (:mod:`llmjp_ds.metrics.curves`), or (label, curve)
    pairs already read, drawn beside this one;
    ``events``: the names of the events to mark (default: every event); ``option``: the verb's option that named
    ``output``, for the messages."""
    run_dir = Path(run_dir)
    metrics = _metrics_of(run_dir)
    output = Path(output) if output is not None else run_dir / "metrics.png"
    if output.is_dir():
        fail(f"cannot write {output}: it is a directory; pass a file name with {option}")
    if not output.parent.is_dir():
        fail(f"cannot write {output}: directory {output.parent} does not exist")
    fig = run_figure(run_dir, beside, events)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # numpy's overflow notes: one line on stderr, the error's
                    fig.savefig(f, format="png", dpi=100)
            except (ValueError, OverflowError) as exc:  # values matplotlib cannot scale
                fail(f"cannot draw {metrics} ({exc}): its values are out of any plottable range; check the file")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600
        os.replace(tmp, output)
    except OSError as exc:
        fail(f"cannot write {output} ({write_failure(exc)}; {free_space(output.parent)} there): choose another "
             f"{option}, or free space or fix the permissions of {output.parent}")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # gone already after the rename
    return output


def _label(source) -> str:
    path = Path(source)
    return path.resolve().name if path.is_dir() else path.stem


def gap_lines(run_dir, beside, last: int = 100) -> list[str]:
    """One line per curve: how far its loss lies from the first of ``beside`` (the reference) over the last
    ``last`` steps both logged, and at the last of them."""
    ref = read_curve(beside[0])
    lines = []
    for source in [run_dir, *beside[1:]]:
        g = gap(ref, read_curve(source), "loss", last)
        if g:
            lines.append(f"{_label(source)} - {_label(beside[0])}: mean |loss difference| {g['mean_abs']:.4g} "
                         f"({100 * g['mean_rel']:.3f} %) over steps {g['first']}-{g['last']}; at step {g['last']} "
                         f"{100 * g['final_rel']:+.3f} %")
        else:
            lines.append(f"{_label(source)} - {_label(beside[0])}: no step logged by both")
    return lines


def cli_main(argv: list[str], verb: str = "plot") -> int:
    parser = argparse.ArgumentParser(
        prog=f"llmjp-ds {verb}",
        description="Draw loss, learning rate and throughput (TFLOP/s per GPU) of a run against step, with "
                    "precision phases shaded and events such as rollbacks marked; an MoE run's router losses, and "
                    "a heat map of its last recorded expert load (MoE layer x expert).")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--output", "-o", metavar="PNG", help="where to write the PNG (default RUN_DIR/metrics.png)")
    parser.add_argument("--beside", action="append", default=[], metavar="SOURCE",
                        help="another llmjp-ds run directory or a Megatron-LM log (written with --log-interval 1): "
                             "its loss and grad norm are drawn beside this run's, and each curve's loss minus the "
                             "first SOURCE's; repeatable")
    args = parser.parse_args(argv)
    path = plot_run(args.run_dir, args.output, args.beside)
    print(f"wrote {path}")
    if args.beside:
        print("\n".join(gap_lines(args.run_dir, args.beside)))
    return 0
