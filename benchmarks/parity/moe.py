"""The mixture-of-experts parity check, ``python -m benchmarks.parity --moe``: ``parity-moe`` (llm-jp-4-32b-a3b's
design at 512 wide: 32 experts, 8 a token, qk-norm, the aux_loss load balancing and the router z-loss) trained by
Megatron-LM's ``pretrain_gpt.py`` and by ``llmjp-ds train`` from one initialisation on the same batches, 300 steps
of four sequences of 2048 (:class:`~benchmarks.parity.spec.MoE`), the eight runs in one call:

============  ====================================================================================
M-A1, M-A2    Megatron-LM, BF16, steps 1..flip, saved (torch_dist) and resumed to the end: A, the reference
M-B1, M-B2    the same with Megatron's router and permutation fusions off (the same math by its torch formulas):
              B, whose difference from A is the BF16 comparison's spread (Megatron run twice alike is bitwise
              equal to itself here, run AJ's first call: a spread of 0 nothing else could meet)
ours-moe      llmjp-ds, BF16, 1..end uninterrupted, against A
M-FA, M-FB    Megatron-LM restarted in FP8 (delayed, hybrid) from M-A1's and from M-B1's checkpoint: FA is the
              FP8 reference; FB (unfused, as B) against it is the spread of an FP8 half after B's BF16 half
ours-moe-fp8  llmjp-ds flipping to FP8 at step flip + 1 in one run (its BF16 half its own), against FA
M-FAu         Megatron-LM restarted in FP8 from M-A1's checkpoint without its MoE fusions: against FA, the spread
              of an FP8 half from the same weights
import-moe,   ``llmjp-ds import-megatron`` of M-A1's checkpoint (weights, Adam's moments, the data position), then
ours-moe-fp8-a  ``llmjp-ds train`` continuing it in FP8 from step flip + 1, against FA: the FP8 half alone, as the
              dense check's ours-fp8 (FA, FAu and it enter FP8 from the same weights and optimizer state)
============  ====================================================================================

The first eight fit one call; M-A1, M-FA, M-FAu, import-moe and ours-moe-fp8-a another (:data:`CALLS`).

Each row (:data:`ROWS`) puts ours against its reference beside Megatron against itself: the LM loss (the mean
|difference| over the last 100 steps at most 1.5 times the spread's, and the last 10 steps' means within 0.3 %:
the issue's target), the router's load-balancing loss and z-loss (logged by both coefficient-free, the mean over
the MoE layers and micro-batches: llmjp_ds/metrics/curves.py), and in BF16 the tokens each expert got. Both record
those every ``MoE.load_interval`` steps: ours ``moe_expert_load`` in metrics.jsonl, Megatron-LM under its ``--save``
(``--save-tokens-per-expert-interval``: ``tokens_per_expert/rank0.jsonl``, each micro-batch's counts of a layer),
whose lines the harness adds to the run's log after :data:`LOADS`. They are compared as each layer's shares of its
choices (half the L1 distance of two layers' shares: 0 when equal, 1 when disjoint). Megatron pads each expert's
rows to a multiple of 16 before its FP8 GEMMs, and records the padded counts: the FP8 runs record none.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from benchmarks.parity.jobs import Job, pretrain
from benchmarks.parity.spec import MoE, Setup, megatron_args, ours_sets

MOE = MoE()
MEGATRON_RUNS = (("megatron-moe-a", ("M-A1", "M-A2")), ("megatron-moe-b", ("M-B1", "M-B2")),
                 ("megatron-moe-fa", ("M-FA",)), ("megatron-moe-fb", ("M-FB",)), ("megatron-moe-fau", ("M-FAu",)))
OURS_RUNS = ("ours-moe", "ours-moe-fp8", "ours-moe-fp8-a")
UNFUSED = ("M-B1", "M-B2", "M-FB", "M-FAu")  # B's runs and FAu: without Megatron's MoE fusions (FUSIONS)
# the runs of each device call (``--only``): the BF16 comparison and the flip in one run; the FP8 half from A's weights
CALLS = (("M-A1", "M-B1", "ours-moe", "ours-moe-fp8", "M-A2", "M-FA", "M-B2", "M-FB"),
         ("M-A1", "M-FA", "M-FAu", "import-moe", "ours-moe-fp8-a"))
FUSIONS = ("--moe-router-fusion", "--moe-permute-fusion")
FROM_INIT = ("M-A1", "M-B1")  # the others start after the flip
# each BF16 Megatron process's --save (A1's and B1's: their checkpoints), under which it records the experts' loads
SAVES = {"M-A1": "megatron-moe-a", "M-B1": "megatron-moe-b", "M-A2": "megatron-moe-a2", "M-B2": "megatron-moe-b2"}
LOADS = "tokens per expert: "
GIB = 20.0  # GPU memory a run may take (the model is 209M parameters: ~4 GB of weights and Adam, ~1 GB of logits)
# (row, ours, Megatron's reference, Megatron's run against it (the spread), the value, whether the target
# holds it to the last 10 steps' mean)
ROWS = tuple((f"MoE {mode}: {what}", ours, ref, spread, key, key == "loss")
             for what, key in (("LM loss", "loss"), ("load-balancing loss", "moe_aux_loss"),
                               ("router z-loss", "moe_z_loss"))
             for mode, ours, ref, spread in (
                 ("BF16, 1..end", "ours-moe", "megatron-moe-a", "megatron-moe-b"),
                 ("FP8 from the flip", "ours-moe-fp8", "megatron-moe-fa", "megatron-moe-fb"),
                 ("FP8 from A's checkpoint", "ours-moe-fp8-a", "megatron-moe-fa", "megatron-moe-fau")))
LOAD_ROW = ("MoE BF16, 1..end: per-expert load (distance of each layer's shares)", "ours-moe", "megatron-moe-a",
            "megatron-moe-b")
FIGURES = (("parity-moe-bf16.png", "ours-moe", ("megatron-moe-a", "megatron-moe-b")),
           ("parity-moe-fp8.png", "ours-moe-fp8", ("megatron-moe-fa", "megatron-moe-fb")),
           ("parity-moe-fp8-a.png", "ours-moe-fp8-a", ("megatron-moe-fa", "megatron-moe-fau")))


def moe_jobs(setup: Setup, work: Path, runs: Path, mlm: Path, blend, tokenizer: str, moe: MoE = MOE) -> list[Job]:
    """The runs, each from the initial weights in ``work/init-moe-*`` (``benchmarks.parity.init --shape``)
    or from its predecessor's checkpoint; a directory an earlier call left in ``work`` is emptied first (Megatron
    appends the loads it records, and a checkpoint there is not this call's)."""
    from llmjp_ds.model.shapes import model_config

    config = model_config(moe.shape)
    saves = {part: work / name for part, name in SAVES.items()}
    record = ["--save-tokens-per-expert-interval", str(moe.load_interval)]

    def megatron(name, load, **kw):
        args = megatron_args(setup, config, blend, tokenizer, str(work / "cache" / name), load=str(load), moe=moe,
                             **kw)
        return pretrain(mlm, [a for a in args if name not in UNFUSED or a not in FUSIONS])

    def ours(name, fp8_from=None):  # LLM-jp-3's optimizer and schedule (the dense runs' preset), the MoE's model
        return [sys.executable, "-m", "llmjp_ds.train", "--preset", "llmjp3-1.8b", "--set", f"run_dir={runs / name}",
                *ours_sets(setup, blend, tokenizer, str(work / "cache" / name), str(work / "init-moe-hf"), fp8_from,
                           moe=moe)]

    def fresh(path):
        return [["rm", "-rf", str(path)]]

    def seconds(steps, save=0.0):  # the start, then ~0.3 s a step with six runs sharing the GPU (not yet measured)
        return 60 + 0.3 * steps + save

    init, rest = work / "init-moe-megatron", setup.steps - setup.flip
    out = []
    for x in "AB":  # the BF16 half, saved at the flip; its continuation, saving its loads alone; the FP8 half
        first, second, ckpt = f"M-{x}1", f"M-{x}2", saves[f"M-{x}1"]
        out += [Job(first, megatron(first, init, finetune=True, save=str(ckpt), exit_at=setup.flip) + record,
                    gib=GIB, estimate_s=seconds(setup.flip, 30), before=fresh(ckpt)),
                # its --save keeps the optimizer (with --no-save-optim, Megatron-LM core_v0.19 leaves the optimizer
                # out of what it loads too, and the resume fails: run AJ's first call)
                Job(second, megatron(second, ckpt, save=str(saves[second])) + record,
                    after=(first,), gib=GIB, estimate_s=seconds(rest, 30), before=fresh(saves[second])),
                Job(f"M-F{x}", megatron(f"M-F{x}", ckpt, fp8=True), after=(first,), gib=GIB,
                    estimate_s=seconds(rest))]
    a1, a2, fa, b1, b2, fb = out
    imported, ckpt = runs / "ours-moe-fp8-a", saves["M-A1"]
    fp8_phase = ours_sets(setup, blend, tokenizer, "", None, setup.flip, moe=moe)[-2:]
    from_a = [Job("M-FAu", megatron("M-FAu", ckpt, fp8=True), after=("M-A1",), gib=GIB, estimate_s=seconds(rest)),
              Job("import-moe", [sys.executable, "-m", "llmjp_ds.cli", "import-megatron", "--load", str(ckpt),
                                 "--run", str(imported), "--preset", "llmjp3-1.8b",
                                 *ours_sets(setup, blend, tokenizer, str(work / "cache" / "ours-moe-fp8-a"), None,
                                            moe=moe)], after=("M-A1",), gib=0, estimate_s=60, before=fresh(imported)),
              Job("ours-moe-fp8-a", [sys.executable, "-m", "llmjp_ds.train", "--config", str(imported / "config.yaml"),
                                     "--set", f"run_dir={imported}", *fp8_phase], after=("import-moe",), gib=GIB,
                  estimate_s=seconds(rest))]
    return [a1, b1,
            Job("ours-moe", ours("ours-moe"), gib=GIB, estimate_s=seconds(setup.steps),
                before=fresh(runs / "ours-moe")),
            Job("ours-moe-fp8", ours("ours-moe-fp8", setup.flip), gib=GIB, estimate_s=seconds(setup.steps),
                before=fresh(runs / "ours-moe-fp8")),
            a2, fa, b2, fb, *from_a]


def expert_load_lines(work: Path, parts) -> list[str]:
    """The loads Megatron recorded in the processes ``parts`` (under each one's ``--save``), as lines of the run's
    log: :data:`LOADS` and the record."""
    files = [work / SAVES[part] / "tokens_per_expert" / "rank0.jsonl" for part in parts if part in SAVES]
    return [LOADS + line for path in files if path.is_file() for line in path.read_text().splitlines() if line]


def megatron_loads(text: str) -> dict[int, list[list[int]]]:
    """The tokens each expert of each MoE layer got at each recorded step, from a log's :data:`LOADS` lines
    (Megatron-LM's records: ``{"iter": step, "block": "decoder", "layer": i, "tpe": [[counts] each micro-batch]}``),
    summed over the micro-batches."""
    steps: dict[int, dict[int, list[int]]] = {}
    for line in text.splitlines():
        if line.startswith(LOADS):
            record = json.loads(line[len(LOADS):])
            if record.get("block") == "decoder":
                steps.setdefault(record["iter"], {})[record["layer"]] = [sum(c) for c in zip(*record["tpe"])]
    return {step: [layers[i] for i in sorted(layers)] for step, layers in sorted(steps.items())}


def ours_loads(run_dir: Path) -> dict[int, list[list[int]]]:
    """The tokens each expert of each MoE layer got at each step our run recorded them (``moe_expert_load``)."""
    from llmjp_ds.metrics.record import current_steps, read_metrics

    return {step: r["moe_expert_load"] for step, r in current_steps(read_metrics(run_dir)).items()
            if "moe_expert_load" in r}


def loads_of(source: Path) -> dict[int, list[list[int]]]:
    return ours_loads(source) if source.is_dir() else megatron_loads(source.read_text(errors="replace"))


def shares(layer: list[int]) -> list[float]:
    total = sum(layer)
    return [n / total if total else 0.0 for n in layer]


def load_distance(reference: dict, other: dict) -> dict:
    """How far ``other``'s loads lie from ``reference``'s at the steps both recorded: half the L1 distance of each
    layer's shares, its mean over the layers and steps, and at the last such step. Empty when they share none."""
    common = [s for s in reference if s in other and len(reference[s]) == len(other[s])]
    per_step = [sum(0.5 * sum(abs(p - q) for p, q in zip(shares(a), shares(b)))
                    for a, b in zip(reference[s], other[s])) / len(reference[s]) for s in common]
    if not per_step:
        return {}
    return {"steps": common, "each": per_step, "mean": sum(per_step) / len(per_step), "last": per_step[-1]}


def _row(what: str, ref: dict, ours: dict, spread: dict, key: str, tail: bool) -> str:
    from llmjp_ds.metrics.curves import gap

    g, s = gap(ref, ours, key), gap(ref, spread, key)
    if not (g and s):
        return f"| {what} | not logged | | | | | |"
    ratio = g["mean_abs"] / s["mean_abs"] if s["mean_abs"] else math.inf
    meets = ratio <= 1.5 and (not tail or abs(g["tail_rel"]) <= 0.003)
    return (f"| {what} | {g['mean_abs']:.4f} | {s['mean_abs']:.4f} | {ratio:.2f} | {100 * g['tail_rel']:+.3f} % | "
            f"{100 * s['tail_rel']:+.3f} % | {'yes' if meets else 'NO'} |")


def _load_row(loads: dict) -> str:
    what, ours, ref, spread = LOAD_ROW
    g, s = (load_distance(loads.get(ref, {}), loads.get(name, {})) for name in (ours, spread))
    if not (g and s):
        return f"| {what} | not run | | | | | |"
    ratio = g["mean"] / s["mean"] if s["mean"] else math.inf
    return (f"| {what} | {g['mean']:.4f} | {s['mean']:.4f} | {ratio:.2f} | {g['last']:.4f} at step {g['steps'][-1]} "
            f"| {s['last']:.4f} | {'yes' if ratio <= 1.5 else 'NO'} |")


HEADER = ["| comparison | ours vs Megatron: mean abs difference, last 100 steps | Megatron vs Megatron (spread) | "
          "ratio | ours vs Megatron: the last 10 steps' means | spread: the same | ratio <= 1.5 (LM loss: and the "
          "last 10 within 0.3 %) |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
NOTE = ("Both stacks log the router's losses without their coefficients (aux 1e-2, z 1e-3 here), each the mean over "
        "the MoE layers and the micro-batches. The per-expert load row: the mean over the steps both recorded (every "
        "`MoE.load_interval`) and the layers of half the L1 distance between two runs' shares of a layer's choices, "
        "and that distance at the last such step.")


def report(setup: Setup, calls: list[dict[str, Path]], out: Path, moe: MoE = MOE) -> str:
    """The MoE check's summary from the sources of one call or several (a row's three runs from one call where a
    call has them all; every MoE run starts from the initial weights, so any call's serves): the rows, the first
    steps of each run, and the figures (parity-moe-bf16.png, parity-moe-fp8.png, parity-moe-fp8-a.png and
    parity-moe-router.png)."""
    from llmjp_ds.metrics.curves import megatron_unmixed, read_curve
    from llmjp_ds.metrics.plot import plot_run

    names = {name for name, _ in MEGATRON_RUNS} | set(OURS_RUNS)
    starts = {name: [1 if p in FROM_INIT else setup.flip + 1 for p in parts] for name, parts in MEGATRON_RUNS}
    c = [{n: megatron_unmixed(read_curve(src), starts.get(n, ())) for n, src in call.items() if n in names}
         for call in calls]

    def pick(*wanted) -> dict[str, int | None]:
        whole = next((i for i, call in enumerate(c) if all(n in call for n in wanted)), None)
        return {n: whole if whole is not None else next((i for i, call in enumerate(c) if n in call), None)
                for n in wanted}

    rows = []
    for what, ours, ref, spread, key, tail in ROWS:
        at = pick(ours, ref, spread)
        rows.append(f"| {what} | not run | | | | | |" if None in at.values() else
                    _row(what, c[at[ref]][ref], c[at[ours]][ours], c[at[spread]][spread], key, tail))
    at = pick(*LOAD_ROW[1:])
    loads = {n: loads_of(calls[i][n]) for n, i in at.items() if i is not None}
    rows.append(_load_row(loads))
    for png, ours, beside in FIGURES:
        at = pick(ours, *beside)
        if None not in at.values():
            # Megatron's curves as the rows read them (a restart's second line unmixed), not its raw lines
            plot_run(calls[at[ours]][ours], out / png, [(Path(calls[at[n]][n]).stem, c[at[n]][n]) for n in beside])
    first = {n: c[i][n] for n, i in pick(*sorted(names)).items() if i is not None}
    if first:
        router_figure(first, loads, out / "parity-moe-router.png")
    steps = (1, 2, setup.flip + 1, setup.flip + 2)
    table = [f"| run | loss / grad norm / load-balancing loss at step {steps[0]} | {steps[1]} | {steps[2]} | "
             f"{steps[3]} |", "| --- | ---: | ---: | ---: | ---: |"]
    table += [f"| {name} | " + " | ".join(_point(curve.get(s)) for s in steps) + " |" for name, curve in first.items()]
    return "\n".join([f"Setup: {setup}", f"MoE: {moe.shape}, aux {moe.aux_loss_coeff}, z {moe.z_loss_coeff}, loads "
                      f"every {moe.load_interval} steps", "", *HEADER, *rows, "", NOTE, "", *table, ""])


def _point(point: dict | None) -> str:
    if not point or "loss" not in point:
        return ""
    return " / ".join(f"{point[k]:.{d}f}" if k in point else "" for k, d in (("loss", 5), ("grad_norm", 3),
                                                                            ("moe_aux_loss", 4)))


def router_figure(curves: dict[str, dict], loads: dict[str, dict], path: Path) -> Path:
    """The router's losses of every run beside each other against step, ours' and B's per-expert shares against
    A's at the last step all three recorded (every layer's experts; on the diagonal where equal), and the distance
    of ours' and B's loads from A's at each recorded step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (aux, z), (scatter, distance) = fig.subplots(2, 2)
    fp8 = {name for _, ours, beside in FIGURES[1:] for name in (ours, *beside)}
    for name, curve in curves.items():
        style = "--" if name in fp8 else "-"
        for ax, key in ((aux, "moe_aux_loss"), (z, "moe_z_loss")):
            xs = [s for s in curve if key in curve[s]]
            if xs:
                ax.plot(xs, [curve[s][key] for s in xs], style, label=name, linewidth=1)
    for ax, title in ((aux, "load-balancing loss (E sum f P, layer mean)"), (z, "router z-loss (layer mean)")):
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    _, ours, ref, spread = LOAD_ROW
    reference = loads.get(ref, {})
    common = [s for s in reference if all(s in loads.get(n, {}) for n in (ours, spread))]
    if common:
        step = common[-1]
        for name in (ours, spread):
            xs = [p for layer in reference[step] for p in shares(layer)]
            ys = [p for layer in loads[name][step] for p in shares(layer)]
            scatter.plot(xs, ys, ".", markersize=3, label=f"{name} (step {step})")
        top = max(p for layer in reference[step] for p in shares(layer))
        scatter.plot([0, top], [0, top], color="black", linewidth=0.6)
        scatter.legend(fontsize="small")
    scatter.set_title(f"each expert's share of its layer's tokens against {ref}'s", fontsize="medium")
    for name in (ours, spread):
        d = load_distance(reference, loads.get(name, {}))
        if d:
            distance.plot(d["steps"], d["each"], "o-", markersize=3, label=f"{name} vs {ref}")
    distance.set_title("distance of the per-expert shares (layer mean)", fontsize="medium")
    distance.set_xlabel("step")
    distance.grid(alpha=0.3)
    if distance.get_lines():
        distance.legend(fontsize="small")
    fig.savefig(path, format="png", dpi=100)
    return path
