"""Training curves from either stack, and how far two of them lie apart.

A curve maps a step to what was logged there: ``loss``, ``grad_norm``, ``lr`` and ``valid_loss``, and an MoE
model's router losses ``moe_aux_loss`` and ``moe_z_loss``. It is read from a llmjp-ds run (its ``metrics.jsonl``)
or from a Megatron-LM training log, whose lines (``training_log`` and ``evaluate_and_print_results`` in
megatron/training/training.py, read from Megatron-Core 0.19) are::

    [...] iteration      250/     500 | consumed samples: 250 | ... | learning rate: 1.5E-04 | ... |
        lm loss: 3.141593E+00 | load_balancing_loss: 1.012345E+00 | z_loss: 2.345678E+00 | loss scale: 1.0 |
        grad norm: 0.271 | ...
    validation loss at iteration 100 | lm loss value: 3.200000E+00 | lm loss PPL: 2.453253E+01 |

An MoE model's two fields are the router's losses without their coefficients, each the mean over the MoE layers
and the micro-batches (Megatron-Core's ``MoEMetricsTracker``: each router records ``loss / coeff`` per layer,
``report`` scales the sum over micro-batches by ``1 / micro-batches`` and divides the sum over layers by their
number), as ours logs them: ``load_balancing_loss`` (``aux_loss``: ``E sum_e f_e P_e``) is ``moe_aux_loss``,
``z_loss`` (``mean_t logsumexp(logits_t)^2``) ``moe_z_loss``.

Megatron-LM averages ``lm loss`` over its ``--log-interval``: only ``--log-interval 1`` gives every step. Steps
count from 1 in both (the step that has just finished). Megatron's scheduler steps before the line is written, so
its ``learning rate`` is the next iteration's: it is kept at that step, where ours logs the rate it stepped with.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from llmjp_ds.errors import fail
from llmjp_ds.metrics.record import METRICS_FILE, current_steps, parse_records

KEYS = ("loss", "grad_norm", "lr", "valid_loss", "moe_aux_loss", "moe_z_loss")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)$")
# the validations during training; the one after it ("... on validation set") reads further batches, and the test
# set is another split
_VALIDATION = re.compile(r"validation loss at iteration (\d+) \|\s*lm loss value:\s*([-+0-9.eEnaif]+)")
_MEGATRON_FIELDS = {"lm loss": "loss", "grad norm": "grad_norm", "learning rate": "lr",
                    "load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}
# the fields training_log prints as a mean over the iterations since its last line (its total_loss_dict)
_MEANS = ("loss", "moe_aux_loss", "moe_z_loss")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def megatron_log_curve(text: str) -> dict[int, dict[str, float]]:
    """The curve in a Megatron-LM log's text (other lines, and fields other than loss, grad norm, learning rate
    and the router's losses, are passed over; a step logged twice, as after a restart, keeps its last line)."""
    curve: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if match:
            step = int(match.group(1))
            for field in match.group(2).split("|"):
                name, _, value = field.partition(":")
                key = _MEGATRON_FIELDS.get(name.strip())
                if key and _number(value.strip()) is not None:
                    # the scheduler steps before the line is written: its rate is the next iteration's
                    curve.setdefault(step + 1 if key == "lr" else step, {})[key] = _number(value.strip())
            continue
        match = _VALIDATION.search(line)
        if match and _number(match.group(2)) is not None:
            curve.setdefault(int(match.group(1)), {})["valid_loss"] = _number(match.group(2))
    last = max((s for s, p in curve.items() if "loss" in p), default=0)
    return {step: point for step, point in sorted(curve.items()) if point and step <= last}


def megatron_unmixed(curve: dict[int, dict[str, float]], starts) -> dict[int, dict[str, float]]:
    """``curve`` (a Megatron-LM log's, at ``--log-interval 1``) with the losses of each process's second iteration
    taken apart from its first. ``starts``: the first iteration of each process in the log. Megatron-Core 0.17 to
    0.19 keep a process's first iteration in ``training_log``'s sums (``should_reset = not is_first_iteration``), so
    its second line prints the mean of the two (NVIDIA/Megatron-LM#6237, fixed by #7092): the iteration's own
    loss is twice that mean less the first. The router's losses share those sums (the MoE tracker adds them to
    ``total_loss_dict``); nothing else in the line is a mean of two."""
    out = {step: dict(point) for step, point in curve.items()}
    for first in starts:
        one, two = out.get(first, {}), out.get(first + 1, {})
        for key in _MEANS:
            if key in one and key in two:
                two[key] = 2 * two[key] - one[key]
    return out


def run_curve(records: list[dict]) -> dict[int, dict[str, float]]:
    """The curve of a llmjp-ds run's metrics records: each step's current record (a step a resume or a rollback
    went back over counts as its last attempt logged it; :func:`llmjp_ds.metrics.record.current_steps`)."""
    curve: dict[int, dict[str, float]] = {}
    for step, record in current_steps(records).items():
        point = curve.setdefault(step, {})
        for key in KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                point[key] = float(value)
    return {step: point for step, point in sorted(curve.items()) if point}


def read_curve(source: str | Path) -> dict[int, dict[str, float]]:
    """The curve of ``source``: a llmjp-ds run directory, its ``metrics.jsonl``, or a Megatron-LM log file."""
    path = Path(source)
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path} ({exc.strerror or exc}): pass a llmjp-ds run directory or a Megatron-LM log file")
    if path.name == METRICS_FILE or path.suffix == ".jsonl":
        curve = run_curve(parse_records(data)[0])
    else:
        curve = megatron_log_curve(data.decode("utf-8", errors="replace"))
    if not any("loss" in point for point in curve.values()):
        fail(f"{source} holds no training loss: pass a llmjp-ds run directory or a Megatron-LM log written with "
             "--log-interval 1")
    return curve


def gap(reference: dict, other: dict, key: str = "loss", last: int = 100, tail: int = 10) -> dict:
    """How far ``other`` lies from ``reference`` in ``key`` over the last ``last`` steps both logged: the mean
    absolute difference, the same relative to the reference, the relative difference at the last such step
    (``final_rel``) and that of the two curves' means over the last ``tail`` of them (``tail_rel``). Empty when
    the curves share no step."""
    steps = [s for s in reference if key in reference[s] and key in other.get(s, {})][-last:]
    if not steps:
        return {}
    diffs = [abs(other[s][key] - reference[s][key]) for s in steps]
    end = steps[-1]
    return {"steps": len(steps), "first": steps[0], "last": end,
            "mean_abs": sum(diffs) / len(diffs),
            "mean_rel": sum(d / abs(reference[s][key]) for d, s in zip(diffs, steps)) / len(diffs),
            "final_rel": (other[end][key] - reference[end][key]) / abs(reference[end][key]),
            "tail_rel": sum(other[s][key] - reference[s][key] for s in steps[-tail:])
            / abs(sum(reference[s][key] for s in steps[-tail:]))}
