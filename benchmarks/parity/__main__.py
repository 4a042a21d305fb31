"""Megatron-LM and llmjp-ds, trained side by side on one GPU: ``python -m benchmarks.parity --megatron-lm DIR``.

``DIR`` is a Megatron-LM checkout at core_v0.19 (its ``pretrain_gpt.py``, ``gpt_builders.py`` and
``model_provider.py``; Megatron-Core itself is the installed ``megatron-core``). The runs, two at a time:

======  =========================================================================================
A       Megatron-LM, BF16, steps 1..flip, saves (torch_dist, distributed optimizer) and exits; then
        resumes from that checkpoint to the end: the reference, and Megatron continuing itself
B       Megatron-LM, BF16, 1..end uninterrupted: Megatron-Core against itself (kernels are not
        bit-deterministic), the spread every comparison is measured against
ours    llmjp-ds, BF16, 1..end, from the same initial weights and batches
A3      Megatron-LM resumed from A's checkpoint a second time, BF16: A3 - A is the spread of a
        continuation from one checkpoint
F1, F2  Megatron-LM restarted from A's checkpoint with FP8 (delayed, hybrid), flip..end: how LLM-jp
        flipped its 172B run on Megatron-LM; F2 - F1 is the FP8 spread
import  ``llmjp-ds import-megatron`` of A's checkpoint, then ``ours-bf16`` (the round trip, against
        A, beside A3) and ``ours-fp8`` (flipping to FP8 at the same step, against F1, beside F2) continue it here
======  =========================================================================================

``--recipe`` trains LLM-jp-4's recipe instead (spec.Recipe: a stable WSD run whose global batch grows from one
sequence to four by Megatron's step batch-size schedule, counted in samples, and a decay branch from its checkpoint
on another blend):

==========  =====================================================================================
W-A1, W-A2  Megatron-LM, the stable run to the branch step, saved; then resumed from it to the end
W-B         Megatron-LM, the stable run uninterrupted: ``ours-wsd``'s reference; W-A against it is the spread
ours-wsd    llmjp-ds, the stable run uninterrupted (``train.batch_changes``, ``optim.decay_style: WSD``)
D1, D2      Megatron-LM restarted twice from W-A1's checkpoint as LLM-jp's decay runs are
            (``--override-opt_param-scheduler --min-lr 0 --lr-wsd-decay-style minus_sqrt``, the decay over
            the rest of the run, another ``--data-path``): D2 - D1 is the spread of a decay branch
import-w    ``llmjp-ds import-megatron`` of W-A1's checkpoint; ``branch``: ``llmjp-ds branch`` of it with D1's
            decay and blend (a data phase from the branch step); ``ours-decay`` trains the branch to the end
==========  =====================================================================================

``--moe`` trains a small mixture of experts instead (benchmarks/parity/moe.py: Megatron-LM's A and B, each saved at
the flip and resumed, and its FP8 restarts from both checkpoints, beside ``ours-moe`` and ``ours-moe-fp8``; in a
second call its FP8 half from A's checkpoint, fused and not, beside ours importing that checkpoint; the LM loss, the
router's losses and the per-expert loads).

``--report-from DIR ...`` trains nothing and reports on earlier calls' curves. Writes to ``--out``:
``summary-parity.md`` (the gaps, each against its spread, and the first steps),
``parity-bf16.png``, ``parity-fp8.png``, ``parity-roundtrip.png``, ``parity-wsd.png``, ``parity-decay.png``
(``llmjp-ds plot --beside``; with ``--moe`` ``parity-moe-bf16.png``, ``parity-moe-fp8.png``,
``parity-moe-fp8-a.png``, ``parity-moe-router.png``),
``parity-curves.tgz`` (each run's per-step loss, grad norm, lr and validation loss as JSONL, Megatron's log lines
they come from, and the tail of every log), and ``megatron-fixtures.tgz`` (benchmarks/parity/fixtures.py's tiny
checkpoints, written by Megatron-LM beside the runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.parity import moe
from benchmarks.parity.jobs import Job, pretrain
from benchmarks.parity.spec import Recipe, Setup, branch_sets, megatron_args, megatron_env, ours_sets

ROOT = Path(__file__).resolve().parents[2]
# a line that ends a run at once: Megatron-LM loads non-strictly (and prints this) when a name did not match, and
# would train on from its own initialisation (any other failure ends the process by itself)
FATAL = ("load_return:",)
# three corpora of the machine's Python sources, dealt from one (benchmarks/real_text_corpus.py --parts 3): real
# text that no run repeats within its samples. The bundled demo corpus is generated from templates; the 1.8B learnt
# them within 300 steps, each run at its own pace, and Megatron's two runs then differed by up to 1.4 on their
# samples (run AD)
BLEND = (("python-1", 0.5), ("python-2", 0.3), ("python-3", 0.2))


def prepare(work: Path, tokenizer: str, megabytes: float) -> list[tuple[float, str]]:
    """The blend: ``megabytes`` of the machine's Python sources, tokenized with the LLM-jp v3 tokenizer and dealt
    into the blend's corpora."""
    corpus = work / "corpus"
    if not all((corpus / f"{name}_text_document.idx").exists() for name, _ in BLEND):
        subprocess.run([sys.executable, "benchmarks/real_text_corpus.py", "--output-dir", str(corpus),
                        "--tokenizer", tokenizer, "--megabytes", str(megabytes), "--parts", str(len(BLEND))],
                       check=True, cwd=ROOT)
    return [(weight, str(corpus / f"{name}_text_document")) for name, weight in BLEND]


def jobs(setup: Setup, work: Path, runs: Path, mlm: Path, blend, tokenizer: str) -> list[Job]:
    from llmjp_ds.model.shapes import model_config

    config = model_config("llmjp3-1.8b")
    ckpt = str(work / "megatron-a")

    def megatron(name, **kw):
        return pretrain(mlm, megatron_args(setup, config, blend, tokenizer, str(work / "cache" / name), **kw))

    def ours(name, run_dir, init_hf=None, fp8_from=None):
        return [sys.executable, "-m", "llmjp_ds.train", "--preset", "llmjp3-1.8b", "--set", f"run_dir={run_dir}",
                *ours_sets(setup, blend, tokenizer, str(work / "cache" / name), init_hf, fp8_from)]

    init = str(work / "init-megatron")
    imported = runs / "imported"
    ours_import = ours_sets(setup, blend, tokenizer, str(work / "cache" / "import"), None)
    def continued(name, *sets):  # the imported run, as its user continues it: its own config.yaml
        return [sys.executable, "-m", "llmjp_ds.train", "--config", str(runs / name / "config.yaml"), "--set",
                f"run_dir={runs / name}", "--set", f"data.cache_dir={work / 'cache' / name}", *sets]

    fork = lambda name: [["cp", "-al", str(imported), str(runs / name)]]  # noqa: E731  the checkpoint, shared
    # seconds: the start (~45), the steps with the GPU shared (~0.33 s a sequence), a save
    third, start = 0.33 * setup.global_batch, 45
    rest = setup.steps - setup.flip
    return [
        Job("fixtures", [sys.executable, "-m", "benchmarks.parity.fixtures", "--megatron-lm", str(mlm), "--out",
                         str(work / "fixtures")], gib=2, estimate_s=60),
        Job("A1", megatron("A1", load=init, finetune=True, save=ckpt, exit_at=setup.flip),
            estimate_s=start + setup.flip * third + 30),
        Job("B", megatron("B", load=init, finetune=True), estimate_s=start + setup.steps * third),
        Job("ours", ours("ours", runs / "ours", init_hf=str(work / "init-hf")),
            estimate_s=start + setup.steps * third),
        # after A1, in the order they start: each comparison's two runs before the spreads they are judged against
        Job("A2", megatron("A2", load=ckpt), after=("A1",), estimate_s=start + rest * third),
        Job("import", [sys.executable, "-m", "llmjp_ds.cli", "import-megatron", "--load", ckpt, "--run",
                       str(imported), "--preset", "llmjp3-1.8b", *ours_import], after=("A1",), gib=0),
        Job("F1", megatron("F1", load=ckpt, fp8=True), after=("A1",), gib=48, estimate_s=start + rest * third),
        Job("ours-fp8", continued("ours-fp8", "--set", ours_sets(setup, blend, tokenizer, "", None, setup.flip)[-1]),
            after=("import",), before=fork("ours-fp8"), estimate_s=start + rest * third),
        Job("ours-bf16", continued("ours-bf16"), after=("import",), before=fork("ours-bf16"),
            estimate_s=start + rest * third),
        Job("F2", megatron("F2", load=ckpt, fp8=True), after=("A1",), gib=48, estimate_s=start + rest * third),
        Job("A3", megatron("A3", load=ckpt), after=("A1",), estimate_s=start + rest * third),
    ]


def recipe_jobs(setup: Setup, recipe: Recipe, work: Path, runs: Path, mlm: Path, blend, tokenizer: str) -> list[Job]:
    """LLM-jp-4's recipe (``--recipe``): the stable run (W-A1 and W-A2, W-B, ours-wsd) and the decay branch from
    W-A1's checkpoint (D1, D2, import-w, branch, ours-decay)."""
    from llmjp_ds.model.shapes import model_config

    config = model_config("llmjp3-1.8b")
    ckpt, init, imported, branched = str(work / "megatron-wa"), str(work / "init-megatron"), runs / "imported-w", \
        runs / "ours-decay"
    other = [(weight, path) for weight, (_, path) in zip(recipe.decay_weights, blend)]

    def megatron(name, run_blend=blend, **kw):
        return pretrain(mlm, megatron_args(setup, config, run_blend, tokenizer, str(work / "cache" / name),
                                            recipe=recipe, **kw))

    def stable(name, init_hf=None):
        return ours_sets(setup, blend, tokenizer, str(work / "cache" / name), init_hf, recipe=recipe)

    def seconds(sequences):  # the start, then ~0.33 s a sequence with the GPU shared (run AF)
        return 45 + 0.33 * sequences

    whole = recipe.train_samples(setup.seq_len)
    first = recipe.consumed(recipe.branch, setup.seq_len)
    return [
        # a checkpoint an earlier call left in --work is not this call's: the runs after W-A1 read the one it saves
        Job("W-A1", megatron("W-A1", load=init, finetune=True, save=ckpt, exit_at=recipe.branch),
            before=[["rm", "-rf", ckpt]], estimate_s=seconds(first) + 30),
        Job("W-B", megatron("W-B", load=init, finetune=True), estimate_s=seconds(whole)),
        Job("ours-wsd", [sys.executable, "-m", "llmjp_ds.train", "--preset", "llmjp3-1.8b", "--set",
                         f"run_dir={runs / 'ours-wsd'}", *stable("ours-wsd", str(work / "init-hf"))],
            estimate_s=seconds(whole)),
        Job("W-A2", megatron("W-A2", load=ckpt), after=("W-A1",), estimate_s=seconds(whole - first)),
        Job("D1", megatron("D1", other, load=ckpt, decay=True), after=("W-A1",), estimate_s=seconds(whole - first)),
        Job("import-w", [sys.executable, "-m", "llmjp_ds.cli", "import-megatron", "--load", ckpt, "--run",
                         str(imported), "--preset", "llmjp3-1.8b", *stable("import-w")], after=("W-A1",), gib=0,
            estimate_s=100),
        Job("branch", [sys.executable, "-m", "llmjp_ds.cli", "branch", "--from", str(imported), "--run",
                       str(branched), *branch_sets(setup, recipe, other)], after=("import-w",), gib=0, estimate_s=30),
        Job("ours-decay", [sys.executable, "-m", "llmjp_ds.train", "--config", str(branched / "config.yaml"),
                           "--set", f"run_dir={branched}", "--set", f"data.cache_dir={work / 'cache' / 'ours-decay'}"],
            after=("branch",), estimate_s=seconds(whole - first)),
        Job("D2", megatron("D2", other, load=ckpt, decay=True), after=("W-A1",), estimate_s=seconds(whole - first)),
    ]


def _log_has_fatal(log: Path) -> str | None:
    """The line of ``log`` that ends its run: Megatron's non-strict load naming keys other than TE's extra state
    (entries a release checkpoint may lack without a weight missing). Its DDP wrapper returns no keys (``None``):
    the first step's loss and grad norm, beside ours from the same weights and batch, say whether they loaded."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if any(f in line for f in FATAL):
            keys = re.findall(r"'([^']+)'", line)
            if keys and any(not k.endswith("_extra_state") for k in keys):
                return line[:4000]
    return None


def schedule(all_jobs: list[Job], logs: Path, deadline: float, gib: float) -> None:
    """Start each job once its predecessors are done and the running jobs' GPU memory leaves it room within
    ``gib``, none that would not end before ``deadline``; end a job whose log shows a fatal line, or that outlives
    the deadline."""
    env = dict(megatron_env(), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    by_name = {j.name: j for j in all_jobs}
    while any(j.state in ("waiting", "running") for j in all_jobs):
        for job in all_jobs:
            if job.state == "running":
                fatal = _log_has_fatal(logs / f"{job.name}.log")
                code = job.proc.poll()
                if fatal or time.time() > deadline:  # torchrun's worker too: the run's whole session
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(job.proc.pid, signal.SIGKILL)
                    job.proc.wait()
                    job.state = "failed"
                    tail = (logs / f"{job.name}.log").read_text(errors="replace").splitlines()[-25:]
                    print(f"[parity] {job.name} ended: {fatal or 'out of time'}; its log ends:", *tail, sep="\n  ",
                          flush=True)
                elif code is not None:
                    job.state = "done" if code == 0 else "failed"
                    print(f"[parity] {job.name} exited {code} after {time.time() - job.started:.0f} s", flush=True)
                    if code:
                        tail = (logs / f"{job.name}.log").read_text(errors="replace").splitlines()[-25:]
                        print(*tail, sep="\n  ", flush=True)
        for job in all_jobs:
            if job.state != "waiting":
                continue
            deps = [by_name[d].state for d in job.after]
            if any(s in ("failed", "skipped") for s in deps) or time.time() + job.estimate_s > deadline:
                job.state = "skipped"
                print(f"[parity] {job.name} skipped", flush=True)
                continue
            busy = sum(j.gib for j in all_jobs if j.state == "running")
            if all(s == "done" for s in deps) and busy + job.gib <= gib:
                for cmd in job.before:
                    subprocess.run(cmd, check=True)
                job.proc = subprocess.Popen(job.cmd, cwd=ROOT, env=env, stdout=open(logs / f"{job.name}.log", "w"),
                                            stderr=subprocess.STDOUT, start_new_session=True)
                job.started, job.state = time.time(), "running"
                print(f"[parity] {job.name} started", flush=True)
        time.sleep(2)


MEGATRON_RUNS = (("megatron-a", ("A1", "A2")), ("megatron-a3", ("A1", "A3")), ("megatron-b", ("B",)),
                 ("megatron-f1", ("F1",)), ("megatron-f2", ("F2",)),
                 ("megatron-wa", ("W-A1", "W-A2")), ("megatron-wb", ("W-B",)), ("megatron-d1", ("D1",)),
                 ("megatron-d2", ("D2",)), *moe.MEGATRON_RUNS)
# the processes that start at step 1; the others start after the flip from A1's checkpoint (or M-A1's, M-B1's), or
# after the recipe's branch step from W-A1's
FROM_INIT = ("A1", "B", "W-A1", "W-B", *moe.FROM_INIT)
RECIPE_PROCESSES = ("W-A1", "W-A2", "W-B", "D1", "D2")
OURS_RUNS = ("ours", "ours-bf16", "ours-fp8", "ours-wsd", "ours-decay", *moe.OURS_RUNS)
RECIPE_CURVES = ("megatron-wa", "megatron-wb", "megatron-d1", "megatron-d2", "ours-wsd", "ours-decay")
# (row, ours, the Megatron run it is compared with, the Megatron run that gives the spread, figure, whether the
# runs start from A's checkpoint: then each pair must come from one call, whose A wrote it)
COMPARISONS = (("BF16, 1..end (against B, uninterrupted like ours)", "ours", "megatron-b", "megatron-a",
                "parity-bf16.png", False),
               ("FP8 from the flip (both from A's checkpoint)", "ours-fp8", "megatron-f1", "megatron-f2",
                "parity-fp8.png", True),
               ("round trip: A imported at the flip, BF16", "ours-bf16", "megatron-a", "megatron-a3",
                "parity-roundtrip.png", True),
               ("recipe: stable WSD, batch 1 to 4, 1..end (against W-B)", "ours-wsd", "megatron-wb", "megatron-wa",
                "parity-wsd.png", False),
               ("recipe: decay branch of W-A's checkpoint, another blend (against D1)", "ours-decay", "megatron-d1",
                "megatron-d2", "parity-decay.png", True))


def curves(runs: Path, logs: Path, ran: set[str]) -> dict[str, Path]:
    """Each run's curve as a source ``llmjp-ds plot --beside`` reads: Megatron's log lines (A's two processes
    joined; an MoE run's per-expert loads after them) and our run directories. A Megatron curve only from processes
    of this call (``ran``): ``--work``'s logs outlive a call, and A1 alone is not A3's curve."""
    from llmjp_ds.metrics.curves import megatron_log_curve

    keep = ("iteration", "validation loss at")
    sources = {}
    for name, parts in MEGATRON_RUNS:
        if not set(parts) <= ran:
            continue
        lines = [line for p in parts for line in (logs / f"{p}.log").read_text(errors="replace").splitlines()
                 if any(k in line for k in keep)] + moe.expert_load_lines(logs.parent, parts)
        if megatron_log_curve("\n".join(lines)):  # a run that ended before its first step has no curve
            sources[name] = logs / f"{name}.log"
            sources[name].write_text("\n".join(lines) + "\n")
    for name in OURS_RUNS:
        if (runs / name / "metrics.jsonl").exists():
            sources[name] = runs / name
    return sources


def sources_in(directory: Path) -> dict[str, Path]:
    """The curves of one earlier call, from its ``parity-curves.tgz`` unpacked into ``directory``."""
    found = {name: directory / f"{name}.log" for name, _ in MEGATRON_RUNS if (directory / f"{name}.log").is_file()}
    found.update({name: directory / name for name in OURS_RUNS if (directory / name / "metrics.jsonl").is_file()})
    return found


def report(setup: Setup, calls: list[dict[str, Path]], out: Path, recipe: Recipe | None = None) -> str:
    """The gaps (mean |loss difference| over the last 100 steps both logged, and at the last step), each beside
    the spread it is judged against, and the figures. ``calls``: the sources of one call or of several. Runs from
    the initial weights may come from any call (every call writes the same ones); a call's checkpoint does not
    outlive it, so a run from A's (or W-A1's) checkpoint is compared with a Megatron run of its own call, and the
    spread is taken within one call too. Megatron's second line after each start is taken apart
    (:func:`~llmjp_ds.metrics.curves.megatron_unmixed`): A, A3, B, W-A1 and W-B start at step 1, A2, A3 and F after the
    flip, W-A2, D1 and D2 after the recipe's branch step."""
    from llmjp_ds.metrics.curves import gap, megatron_unmixed, read_curve
    from llmjp_ds.metrics.plot import plot_run

    recipe = recipe or Recipe()

    def first_step(part):
        if part in FROM_INIT:
            return 1
        return (recipe.branch if part in RECIPE_PROCESSES else setup.flip) + 1

    starts = {name: [first_step(part) for part in parts] for name, parts in MEGATRON_RUNS}
    c = [{name: megatron_unmixed(read_curve(src), starts.get(name, ())) for name, src in call.items()}
         for call in calls]

    def having(*names):
        return next((i for i, call in enumerate(c) if all(n in call for n in names)), None)

    rows = []
    for what, ours, ref, spread, png, from_checkpoint in COMPARISONS:
        if from_checkpoint:
            mine, theirs = having(ours, ref), having(ref, spread)
            at = {ours: mine, ref: mine, spread: theirs}
            spread_ref = theirs
        else:  # one call's three runs where a call has them
            whole = having(ours, ref, spread)
            at = {name: whole if whole is not None else having(name) for name in (ours, ref, spread)}
            spread_ref = at[ref]
        if None in at.values() or spread_ref is None:
            rows.append(f"| {what} | not run | | | | | |")
            continue
        g, s = gap(c[at[ref]][ref], c[at[ours]][ours]), gap(c[spread_ref][ref], c[at[spread]][spread])
        ratio = g["mean_abs"] / s["mean_abs"] if s.get("mean_abs") else float("inf")
        meets = ratio <= 1.5 and abs(g["final_rel"]) <= 0.003  # the targets
        rows.append(f"| {what} | {g['mean_abs']:.4f} | {s['mean_abs']:.4f} | {ratio:.2f} | "
                    f"{100 * g['final_rel']:+.3f} % | {100 * s['final_rel']:+.3f} % | {'yes' if meets else 'NO'} |")
        # the spread's run beside where its difference from the reference drawn is the spread reported
        # Megatron's curves as the rows read them (a restart's second line unmixed), not its raw lines
        drawn = [(ref, at[ref])] + ([(spread, at[spread])] if spread_ref == at[ref] else [])
        plot_run(calls[at[ours]][ours], out / png, [(Path(calls[i][n]).stem, c[i][n]) for n, i in drawn])
    def firsts(steps, recipe_runs):
        return [f"| {name}{f' (call {i + 1})' if len(c) > 1 else ''} | "
                + " | ".join(f"{curve[s]['loss']:.5f} / {curve[s].get('grad_norm', float('nan')):.3f}"
                             if s in curve else "" for s in steps) + " |"
                for i, call in enumerate(c) for name, curve in call.items() if (name in RECIPE_CURVES) == recipe_runs]

    def first_steps(steps, recipe_runs):
        return [f"| run | loss / grad norm at step {steps[0]} | {steps[1]} | {steps[2]} | {steps[3]} |",
                "| --- | ---: | ---: | ---: | ---: |", *firsts(steps, recipe_runs), ""]

    restarts = (1, 2, recipe.branch + 1, recipe.branch + 2)
    recipe_part = [f"Recipe: {recipe}", "", *first_steps(restarts, True)] if firsts(restarts, True) else []
    return "\n".join([
        f"Setup: {setup}", "",
        "| comparison | ours vs Megatron: mean abs loss diff, last 100 steps | Megatron vs Megatron (spread) | "
        "ratio | ours at the last step | spread at the last step | ratio <= 1.5 and last step within 0.3 % |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        *rows, "", *first_steps((1, 2, setup.flip + 1, setup.flip + 2), False), *recipe_part])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout at core_v0.19")
    p.add_argument("--tokenizer", help="the LLM-jp v3 SentencePiece model")
    p.add_argument("--work", type=Path, default=Path("/tmp/parity"))
    p.add_argument("--runs", type=Path, default=None, help="our run directories (default: WORK/runs; the imported "
                   "checkpoint takes 12 bytes a parameter, beside Megatron's 14)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    p.add_argument("--budget-s", type=float, default=560.0, help="stop starting runs that would end later")
    p.add_argument("--gpu-gib", type=float, default=132.0, help="GPU memory the runs sharing it may take together")
    p.add_argument("--megabytes", type=float, default=48.0, help="of Python sources in the blend (~3.3 bytes "
                   "a token: 48 MB are 15M tokens, 3.6 times what 500 steps of 2 sequences read)")
    p.add_argument("--no-fixtures", dest="fixtures", action="store_false",
                   help="leave out benchmarks/parity/fixtures.py's tiny checkpoints")
    p.add_argument("--only", help="these runs alone, comma-separated (e.g. B,ours), each with the runs it follows")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--moe", action="store_true", help="the MoE check's runs (M-A1, M-B1, ours-moe, ours-moe-fp8, "
                      "M-A2, M-FA, M-B2, M-FB; with --only M-A1,M-FA,M-FAu,import-moe,ours-moe-fp8-a the FP8 half from "
                      "A's checkpoint: benchmarks/parity/moe.py) instead; defaults: 300 steps of 4 sequences "
                      "of 2048, the flip at 150 (spec.MoE); with --report-from, their report")
    mode.add_argument("--recipe", action="store_true", help="LLM-jp-4's recipe's runs (W-A1, W-A2, W-B, ours-wsd, D1, "
                   "D2, import-w, branch, ours-decay) instead of the BF16 and FP8 ones; --lr applies to them, --steps, "
                   "--flip and --global-batch do not (spec.Recipe sizes them)")
    p.add_argument("--lr", type=float, help=f"peak LR (default {Setup.lr}); 1e-12 leaves the weights as they "
                   "start, so each step's loss compares the two stacks' batches and forward passes alone")
    p.add_argument("--steps", type=int, help=f"default {Setup.steps}")
    p.add_argument("--flip", type=int, help=f"default {Setup.flip}")
    p.add_argument("--global-batch", type=int, help=f"sequences a step (micro-batches of one; default "
                   f"{Setup.global_batch}): a larger batch narrows the run-to-run spread")
    p.add_argument("--report-from", nargs="+", type=Path, metavar="DIR",
                   help="train nothing: the report of earlier calls, each DIR an unpacked parity-curves.tgz")
    a = p.parse_args(argv)
    given = {k: getattr(a, k) for k in ("steps", "flip", "lr", "global_batch") if getattr(a, k) is not None}
    setup = replace(moe.MOE.setup if a.moe else Setup(), **given)
    setup, recipe = replace(setup, min_lr=setup.lr / 10), Recipe()

    def summarize(calls):
        return moe.report(setup, calls, a.out) if a.moe else report(setup, calls, a.out, recipe)

    a.out.mkdir(parents=True, exist_ok=True)
    if a.report_from:
        return _summarize(a.out, summarize([sources_in(d) for d in a.report_from]), [])
    if not (a.megatron_lm and a.tokenizer):
        p.error("--megatron-lm and --tokenizer are needed to train (or --report-from DIR to report on earlier calls)")
    a.runs = a.runs or a.work / "runs"
    deadline = time.time() + a.budget_s
    logs = a.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    blend = prepare(a.work, a.tokenizer, a.megabytes)
    init, shape = ("init-moe", ["--shape", moe.MOE.shape]) if a.moe else ("init", [])
    if not (a.work / f"{init}-megatron" / "latest_checkpointed_iteration.txt").exists():
        subprocess.run([sys.executable, "-m", "benchmarks.parity.init", "--hf", str(a.work / f"{init}-hf"),
                        "--megatron", str(a.work / f"{init}-megatron"), *shape], check=True, cwd=ROOT)
    if a.moe:
        pool = moe.moe_jobs(setup, a.work, a.runs, a.megatron_lm.resolve(), blend, a.tokenizer)
    elif a.recipe:
        pool = recipe_jobs(setup, recipe, a.work, a.runs, a.megatron_lm.resolve(), blend, a.tokenizer)
    else:
        pool = jobs(setup, a.work, a.runs, a.megatron_lm.resolve(), blend, a.tokenizer)
    only = a.only.split(",") if a.only else list(moe.CALLS[0]) if a.moe else [j.name for j in pool]
    unknown = [name for name in only if name not in {j.name for j in pool}]
    if unknown:
        flag = "--recipe" if a.recipe else "--moe" if a.moe else None
        p.error(f"--only names {', '.join(unknown)}, not among the runs{f' of {flag}' if flag else ''}: "
                f"{', '.join(j.name for j in pool)}" + ("" if flag else " (the recipe's runs need --recipe, the MoE "
                                                        "check's --moe)"))
    all_jobs = [j for j in pool if (a.fixtures or j.name != "fixtures") and j.name in only]
    for job in all_jobs:  # a run whose predecessor is not run has nothing to start from
        missing = [d for d in job.after if d not in {j.name for j in all_jobs}]
        if missing:
            p.error(f"--only names {job.name}, which starts after {', '.join(missing)}: name {', '.join(missing)} too")
    try:
        schedule(all_jobs, logs, deadline, a.gpu_gib)
    finally:
        for job in all_jobs:  # nothing outlives the comparison
            if job.state == "running":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.proc.pid, signal.SIGKILL)
        sources = curves(a.runs, logs, {j.name for j in all_jobs if j.started})
        pack(a, all_jobs, sources, logs)
    summary = summarize([sources])  # reads our run directories: before they go
    shutil.rmtree(a.runs, ignore_errors=True)
    return _summarize(a.out, summary, all_jobs)


def _summarize(out: Path, summary: str, all_jobs: list[Job]) -> int:
    """``summary-parity.md``, with each job's end; non-zero when a run failed or never started."""
    summary += "".join(f"\n- {j.name}: {j.state}" for j in all_jobs) + "\n"
    (out / "summary-parity.md").write_text(summary)
    print(summary, flush=True)
    return 0 if all(j.state == "done" for j in all_jobs) else 1


def _worth_keeping(lines: list[str], i: int) -> bool:
    """A line of a run's log that says what happened: a loaded checkpoint, an error and the traceback before it."""
    if re.search(r"load_return|Error|error:|checkpoint|iteration +(1|2|3)/", lines[i]):
        return True
    return any("Error" in x for x in lines[i + 1:i + 25]) and "Traceback" in "".join(lines[max(0, i - 30):i + 1])


def pack(a, all_jobs: list[Job], sources: dict[str, Path], logs: Path) -> None:
    """The curves and every log's tail in ``parity-curves.tgz``; Megatron-LM's fixtures in
    ``megatron-fixtures.tgz``."""
    with tarfile.open(a.out / "parity-curves.tgz", "w:gz") as tar:
        for name, src in sources.items():
            tar.add(src / "metrics.jsonl" if src.is_dir() else src,
                    arcname=f"{name}/metrics.jsonl" if src.is_dir() else f"{name}.log")  # as sources_in reads them
        for job in all_jobs:  # every log's tail: what a failed run said
            log = logs / f"{job.name}.log"
            if log.exists():
                lines = log.read_text(errors="replace").splitlines()
                said = [x[:4000] for i, x in enumerate(lines) if _worth_keeping(lines, i)]
                tail = said[-200:] + ["-- the log's end --"] + lines[-40:]
                (logs / f"{job.name}.tail").write_text("\n".join(tail) + "\n")
                tar.add(logs / f"{job.name}.tail", arcname=f"tails/{job.name}.log")
        for log in (a.work / "fixtures").glob("*.log"):
            tar.add(log, arcname=f"tails/fixtures-{log.name}")
    if (a.work / "fixtures").is_dir():
        with tarfile.open(a.out / "megatron-fixtures.tgz", "w:gz") as tar:
            tar.add(a.work / "fixtures", arcname="megatron-fixtures", filter=lambda t: None if t.name.endswith(".log")
                    else t)


if __name__ == "__main__":
    sys.exit(main())
