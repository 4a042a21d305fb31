"""``llmjp-ds branch``: a new run that starts from a checkpoint of another with its own schedule (a decay branch
of a WSD run), and optionally its own blend or global batch, leaving the source run and its checkpoints as they are.

LLM-jp-4's decay branches resume a stable-phase checkpoint in a separate Megatron-LM run with
``--override-opt_param-scheduler --min-lr 0 --train-iters N --lr-wsd-decay-style minus_sqrt ...`` while the stable
run goes on. Here the branch is a run directory of its own:

* its checkpoint ``<tag>`` holds hard links to the source tag's files (a copy where they cannot link: another
  filesystem), verified against the source's manifest first; a checkpoint is never written again once committed,
  so the source keeps training (and rotating its own checkpoints) beside its branches;
* its config is the source's at that checkpoint (the marker's ``run_config``) with the overrides given, and
  ``optim.resume_schedule: override`` (Megatron's flag: the branch's schedule from its first step); a new
  ``data.blend`` becomes a data phase from the branch's step, a new ``train.global_batch_size`` a batch change
  there, so the steps before keep their samples;
* ``branch.json`` records where it came from (run, tag, step, consumed samples); the trainer puts it into the
  branch's metrics, its (new) wandb run and, through the export, the HF config.

The branch is built beside its place and renamed into it: a refused branch writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import yaml

from llmjp_ds.checkpoint.lock import refuse_if_held
from llmjp_ds.checkpoint.resume_checks import check_same_past, verify_tag
from llmjp_ds.checkpoint.store import LATEST, MARKER, checkpoint_dir, latest_tag, read_marker, tag_dir, vet_tag
from llmjp_ds.config import add_config_args, apply_set, build_config, load_file, merge
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import atomic_directory, atomic_file, one_line_write_errors
from llmjp_ds.validate import validate_run

BRANCH_FILE = "branch.json"


def read_origin(run_dir) -> dict | None:
    """The ``branch.json`` of ``run_dir`` (None for a run that is no branch)."""
    path = Path(run_dir) / BRANCH_FILE
    if not path.is_file():
        return None
    try:
        origin = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        fail(f"{path} cannot be read ({exc}): restore it from the branch's creation, or remove it to treat the run "
             "as no branch")
    if not isinstance(origin, dict) or not {"run", "tag", "step", "consumed_samples"} <= set(origin):
        fail(f"{path} is not a branch record (it needs run, tag, step and consumed_samples): restore it")
    return origin


def branch_config(source: dict, step: int, overrides: dict) -> dict:
    """The branch's config dict: ``source`` (the source run's resolved config) with ``overrides`` merged over it;
    a changed ``data.blend`` becomes a data phase from ``step``, a changed ``train.global_batch_size`` a batch
    change there (the steps before keep the source's blend and batches)."""
    data = merge(source, overrides)
    new_blend, old_blend = data["data"]["blend"], source["data"]["blend"]
    if [str(x) for x in new_blend] != [str(x) for x in old_blend]:
        data["data"]["blend"] = old_blend
        kept = [p for p in data["data"].get("phases", []) if p["start_step"] <= step]
        data["data"]["phases"] = kept + [{"start_step": step + 1, "blend": new_blend, "count": "run"}]
    new_batch, old_batch = data["train"]["global_batch_size"], source["train"]["global_batch_size"]
    if new_batch != old_batch:
        data["train"]["global_batch_size"] = old_batch
        kept = [c for c in data["train"].get("batch_changes", []) if c["start_step"] <= step]
        data["train"]["batch_changes"] = kept + [{"start_step": step + 1, "global_batch_size": new_batch}]
    if "resume_schedule" not in overrides.get("optim", {}):
        data["optim"]["resume_schedule"] = "override"
    return data


def _link_tag(source: Path, target: Path, files) -> str:
    """Hard links to the source tag's files (copies where a link cannot be made); how they were made."""
    how = "hard links"
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / name, target / name)
        except OSError:  # another filesystem, or one without hard links
            shutil.copy2(source / name, target / name)
            how = "copies"
    return how


def create_branch(source_run, run, tag: str | None = None, config: str | None = None, sets=()) -> dict:
    """Write the branch run directory ``run`` from checkpoint ``tag`` (default: latest) of ``source_run``, with
    the overrides of ``config`` (a YAML/JSON file) and ``sets`` (``key=value``). Every check runs first."""
    source_run, run_dir = Path(source_run), Path(run)
    if not checkpoint_dir(source_run).is_dir():
        fail(f"{source_run} holds no checkpoints: pass --from the run directory of the run to branch from")
    if run_dir.resolve() == source_run.resolve() or source_run.resolve() in run_dir.resolve().parents:
        fail(f"--run {run_dir} is inside the source run {source_run}: a branch is a run directory of its own")
    if run_dir.exists() or run_dir.is_symlink():
        refuse_if_held(run_dir, "training")  # a live run: name its holder
        fail(f"{run_dir} already exists: a branch starts a new run directory (two runs never share one); choose "
             "another --run")
    tag = tag or latest_tag(source_run)
    if tag is None:
        fail(f"{source_run} has no complete checkpoint to branch from: pass --tag, or let it save first")
    marker = read_marker(source_run, tag)
    where = tag_dir(source_run, tag)
    damaged = verify_tag(vet_tag(source_run, tag), marker)
    if damaged:
        fail(f"checkpoint {tag} of {source_run} fails its manifest ({damaged}): branch from another --tag")
    if not marker.run_config or marker.consumed_samples is None:
        fail(f"checkpoint {tag} of {source_run} records no run config (written by an earlier release): resume the "
             "source run once so that it saves a checkpoint that does, and branch from that one")
    step = marker.step
    overrides = load_file(config) if config else {}
    for assignment in sets:
        overrides = apply_set(overrides, assignment)
    overrides.pop("preset", None)
    overrides["run_dir"] = str(run_dir)
    data = branch_config(marker.run_config, step, overrides)
    branch_cfg = build_config(data)
    if branch_cfg.train.steps <= step:
        fail(f"the branch starts at step {step} and would end at train.steps={branch_cfg.train.steps}: set "
             f"train.steps beyond {step}")
    check_same_past(marker, branch_cfg, f"checkpoint {tag} of {source_run} (step {step})",
                    f"branch from a checkpoint before that step")
    validate_run(branch_cfg, marker.pipeline_stages * (marker.data_parallel or 1) * marker.tensor_parallel)
    origin = {"run": str(source_run.resolve()), "tag": tag, "step": step,
              "consumed_samples": marker.consumed_samples, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with one_line_write_errors(run_dir, "free space or choose another --run, then run it again; nothing was "
                                        "written"), atomic_directory(run_dir) as tmp:
        target = checkpoint_dir(tmp) / tag
        target.mkdir(parents=True)
        how = _link_tag(where, target, [*marker.files, MARKER])
        with atomic_file(checkpoint_dir(tmp) / LATEST, "w") as f:
            f.write(tag)
        if (source_run / "tokenizer").is_dir():
            shutil.copytree(source_run / "tokenizer", tmp / "tokenizer", symlinks=True)
        with atomic_file(tmp / BRANCH_FILE, "w") as f:
            json.dump(origin, f, indent=1)
        with atomic_file(tmp / "config.yaml", "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
    return {**origin, "run_dir": str(run_dir), "files": how, "config": str(run_dir / "config.yaml")}


def cli_main(argv: list[str], verb: str = "branch") -> int:
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.split("\n\n")[0])  # its first paragraph
    p.add_argument("--from", dest="source", required=True, metavar="RUN_DIR", help="the run to branch from")
    p.add_argument("--tag", help="its checkpoint to start from (default: its latest)")
    p.add_argument("--run", required=True, metavar="NEW_RUN_DIR", help="the branch's run directory (must not exist)")
    add_config_args(p, config="a YAML/JSON file of overrides (e.g. the decay's optim and train sections)",
                    preset=False, example="optim.wsd_decay_style=minus_sqrt")
    a = p.parse_args(argv)
    out = create_branch(a.source, a.run, a.tag, a.config, a.sets)
    print(f"branched {out['run_dir']} from {out['run']} at {out['tag']} (step {out['step']}, "
          f"{out['consumed_samples']} samples consumed; its files are {out['files']} of the source's); train it with: "
          f"llmjp-ds train --config {out['config']}")
    return 0
