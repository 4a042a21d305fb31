"""Checkpoints: save and resume through DeepSpeed (atomically), export to Hugging Face, import from it.

Layout of a run directory::

    <run_dir>/config.yaml                 the resolved run config
    <run_dir>/tokenizer/                  the tokenizer (HF files + tokenizer.model), exported with the model
    <run_dir>/checkpoints/step00000100/   DeepSpeed's files for that step + llmjp_ds.json (written last)
    <run_dir>/checkpoints/latest          names the newest complete checkpoint; moved only after a save is done
    <run_dir>/metrics.jsonl, wandb/

A save writes DeepSpeed's files, waits for every rank, then rank 0 writes the ``llmjp_ds.json`` marker and
replaces ``latest`` atomically, then deletes checkpoints beyond ``keep_last``. A kill at any moment leaves
``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from llmjp_ds.errors import fail
from llmjp_ds.io_utils import atomic_file
from llmjp_ds.parallel.layout import Layout

MARKER = "llmjp_ds.json"
LATEST = "latest"
_TAG = re.compile(r"^step(\d{8})(?:-r(\d+))?$")


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int, rollbacks: int = 0) -> str:
    return f"step{step:08d}" + (f"-r{rollbacks}" if rollbacks else "")


def complete_tags(run_dir) -> list[tuple[int, str]]:
    """(step, tag) of every complete checkpoint, oldest first."""
    root = checkpoint_dir(run_dir)
    out = []
    if root.is_dir():
        for d in root.iterdir():
            m = _TAG.match(d.name)
            if m and (d / MARKER).is_file():
                out.append((int(m.group(1)), int(m.group(2) or 0), d.name))
    return [(step, tag) for step, _, tag in sorted(out)]


def latest_tag(run_dir) -> str | None:
    path = checkpoint_dir(run_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not (checkpoint_dir(run_dir) / tag / MARKER).is_file():
        fail(f"{path} names {tag!r}, which is not a complete checkpoint: the run directory was altered by hand; "
             f"point latest at one of {[t for _, t in complete_tags(run_dir)][-3:]}")
    return tag


@dataclass
class CheckpointMeta:
    """What a checkpoint's marker (``llmjp_ds.json``) records: enough to check a resume and to read the weights
    back without the run config. Written last: its presence means the checkpoint is complete."""

    model_config: dict
    zero_stage: int
    pipeline_stages: int
    dtype: str
    seq_len: int
    fp8_lm_head: bool = False
    data_parallel: int | None = None  # None in checkpoints of earlier releases (the files tell)
    tensor_parallel: int = 1
    step: int | None = None
    tag: str | None = None

    @classmethod
    def for_run(cls, cfg, model_config, data_parallel: int) -> "CheckpointMeta":
        from llmjp_ds.config import seq_len_of

        return cls(model_config=model_config.to_dict(), zero_stage=cfg.parallel.zero_stage,
                   pipeline_stages=cfg.parallel.pipeline_stages, dtype=cfg.precision.dtype,
                   seq_len=seq_len_of(cfg, model_config), fp8_lm_head=cfg.precision.fp8_lm_head,
                   data_parallel=data_parallel, tensor_parallel=cfg.parallel.tensor_parallel)

    @classmethod
    def from_dict(cls, data: dict) -> "CheckpointMeta":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


def read_marker(run_dir, tag: str) -> CheckpointMeta:
    path = checkpoint_dir(run_dir) / tag / MARKER
    if not path.is_file():
        known = [t for _, t in complete_tags(run_dir)]
        fail(f"no complete checkpoint {tag!r} in {checkpoint_dir(run_dir)}: available tags are "
             f"{', '.join(known[-5:]) or 'none'}")
    try:
        data = json.loads(path.read_text())
        return CheckpointMeta.from_dict(data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as exc:
        fail(f"{path} is not a valid checkpoint marker ({exc}): the checkpoint was altered by hand; point {LATEST} "
             "at another tag")


def check_writable(run_dir) -> None:
    """The run directory, or for a new run its nearest existing parent, must be writable; creates nothing."""
    run_dir = Path(run_dir)
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        fail(f"run_dir {run_dir}: {existing} is a file, not a directory; choose another run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"run_dir {run_dir} is not writable ({existing} is read-only for this user): choose another run_dir "
             "or fix its permissions or mount")


# the fields that fix the weights' shapes: a checkpoint of another shape cannot be loaded into this model
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")


def saved_layout(run_dir, tag: str, marker: CheckpointMeta) -> Layout:
    """The layout of the run that wrote checkpoint ``tag``."""
    if marker.data_parallel is not None:
        pipeline, data, tensor = marker.pipeline_stages, marker.data_parallel, marker.tensor_parallel
    else:
        from llmjp_ds.parallel.reshape import saved_layout as from_files

        (pipeline, data), tensor = from_files(checkpoint_dir(run_dir) / tag), 1
    return Layout(world=pipeline * data * tensor, pipeline=pipeline, tensor=tensor)


def check_resume(run_dir, model_config: dict, fp8_lm_head: bool = False, layout=None,
                 zero_stage: int | None = None) -> str | None:
    """The tag a run will resume from (None for a fresh run), checked before any process group exists:
    ``latest`` must name a complete checkpoint, saved from a model of the same shape and the same kind of LM head
    (an FP8 head carries TE scaling state that a BF16 head has no slot for, and the other way round), and, if
    it was saved on another layout than ``layout``, with ZeRO-1, as this run is (``parallel.reshape``)."""
    tag = latest_tag(run_dir)
    if tag is None:
        return None
    marker = read_marker(run_dir, tag)
    if marker.fp8_lm_head != fp8_lm_head:
        fail(f"{checkpoint_dir(run_dir) / tag} was saved with precision.fp8_lm_head={str(not fp8_lm_head).lower()}: "
             f"resume with the same setting, or set a new run_dir to start afresh")
    saved = marker.model_config
    diff = [f"{k} {saved.get(k)} saved, {model_config.get(k)} now"
            for k in SHAPE_KEYS if saved.get(k) != model_config.get(k)]
    if diff:
        fail(f"{checkpoint_dir(run_dir) / tag} was saved from another model shape ({', '.join(diff)}): resume with "
             f"the run's own model settings, or set a new run_dir to start afresh")
    if layout is not None and (marker.zero_stage != 1 or zero_stage != 1):
        saved = saved_layout(run_dir, tag, marker)
        if saved != layout:
            fail(f"{checkpoint_dir(run_dir) / tag} was saved on {saved.name} with ZeRO-{marker.zero_stage}; resuming it "
                 f"on {layout.name} (ZeRO-{zero_stage}) works with ZeRO-1 on both sides only: relaunch on "
                 f"{saved.name}")
    return tag


def save(engine, run_dir, step: int, client_state: dict, meta: CheckpointMeta, keep_last: int,
         rollbacks: int = 0) -> str:
    import torch.distributed as dist

    root = checkpoint_dir(run_dir)
    tag = tag_for(step, rollbacks)
    # a run resumed behind a complete tag (killed between its marker and `latest`) saves that tag again, in
    # place: each rank drops the old marker before it rewrites files, so a marker always means complete files
    latest = root / LATEST
    if not (latest.is_file() and latest.read_text().strip() == tag):
        (root / tag / MARKER).unlink(missing_ok=True)
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        from llmjp_ds.parallel.failure import is_peer_failure

        if is_peer_failure(exc):  # another rank died inside DeepSpeed's save: that rank says why
            raise
        _save_failed(root, tag, exc)
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            with atomic_file(root / tag / MARKER, "w") as f:
                json.dump({**meta.to_dict(), "step": step, "tag": tag}, f, indent=2)
            with atomic_file(root / LATEST, "w") as f:
                f.write(tag)
        except OSError as exc:
            _save_failed(root, tag, exc)
        prune(run_dir, keep_last)
    dist.barrier()
    return tag


def _save_failed(root: Path, tag: str, exc: BaseException):
    """A write of the save failed (full disk, quota, I/O error): drop the partial tag, say what ``latest`` still
    names, stop. Under several ranks the others stop at their next collective (or the process-group timeout)."""
    if not (root / tag / MARKER).is_file():
        shutil.rmtree(root / tag, ignore_errors=True)
    reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    if "unexpected pos" in reason:  # torch's zip writer, when the OS refused part of a write
        reason = "a write was cut short"
    try:
        n = shutil.disk_usage(root).free
        free = f"{n / 2**30:.1f} GiB free" if n >= 2**30 else f"{n / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    fail(f"saving checkpoint {tag} to {root} failed ({reason}; {free}): is the disk full? Free space or lower "
         f"checkpoint.keep_last, then resume; {LATEST} still names "
         + (f"the complete checkpoint {latest}" if latest else "no checkpoint (nothing was saved yet)"))


def remove_tag(run_dir, tag: str) -> None:
    """Delete a checkpoint, its marker first: a kill in the middle leaves an incomplete tag (pruned later), never
    a marker over missing files."""
    (checkpoint_dir(run_dir) / tag / MARKER).unlink(missing_ok=True)
    shutil.rmtree(checkpoint_dir(run_dir) / tag, ignore_errors=True)


def prune(run_dir, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` and any incomplete ones left by a kill."""
    root = checkpoint_dir(run_dir)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    keep = {t for _, t in complete_tags(run_dir)[-keep_last:]} | {latest}
    for d in root.iterdir():
        if d.is_dir() and _TAG.match(d.name) and d.name not in keep:
            remove_tag(run_dir, d.name)
        elif d.name.startswith(".") and d.name.endswith(".tmp") and d.is_file():
            d.unlink(missing_ok=True)  # an atomic_file temp (latest, marker) left by a kill -9


def discard_after(run_dir, step: int) -> None:
    """Delete the checkpoints of an abandoned timeline (steps after ``step``), e.g. after an FP8 rollback, so
    that pruning by step number and a later rollback only ever see the timeline that continues."""
    for tag_step, tag in complete_tags(run_dir):
        if tag_step > step:
            remove_tag(run_dir, tag)


@contextlib.contextmanager
def trusted_te_extra_state():
    """Our own checkpoints hold TE's pickled DelayedScaling state (amax history, scales). TE >= 2.18 refuses
    pickled extra state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1; we allow it only while loading a
    checkpoint from this run's own directory, never for files from elsewhere (export and import-hf drop
    ``_extra_state`` altogether)."""
    key = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def read_client_state(run_dir, tag: str) -> dict:
    """The trainer's own state saved with checkpoint ``tag`` (train state, precision, guard, wandb id), read
    without an engine (a resume on another layout). The run's own directory, as :func:`load` reads it."""
    with trusted_te_extra_state():
        state = torch.load(checkpoint_dir(run_dir) / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)
    return {k: state[k] for k in ("train_state", "precision", "guard", "wandb_run_id", "rng") if k in state}


def load(engine, run_dir, tag: str) -> dict:
    with trusted_te_extra_state():
        path, client_state = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag,
                                                    load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None:
        fail(f"DeepSpeed could not load checkpoint {tag!r} from {checkpoint_dir(run_dir)}")
    return client_state or {}


# --- reading a checkpoint without DeepSpeed's engine (export) -------------------------------------------

def read_model_state(run_dir, tag: str, marker: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The model's full state dict (our names) from a ZeRO-0..3 or pipeline checkpoint, on CPU. The directory
    may come from anywhere (a collaborator's bucket, a download): every file is read with weights_only=True
    (llmjp_ds.safe_load), and one that names code is refused before anything of it is unpickled."""
    from llmjp_ds.model.hf_adapter import pipeline_name_to_ours, tp_merge_state_dicts
    from llmjp_ds.safe_load import load_untrusted, vet_files

    d = checkpoint_dir(run_dir) / tag
    if marker.pipeline_stages > 1:
        n = marker.model_config["num_hidden_layers"]
        shards: list[dict] = [{} for _ in range(marker.tensor_parallel)]
        for f in sorted(d.glob("layer_*-model_*states.pt")):
            idx, tp_rank = _pipeline_file_ranks(f.name)
            for name, tensor in load_untrusted(f).items():
                shards[tp_rank][pipeline_name_to_ours(idx, n, name)] = tensor
        return tp_merge_state_dicts(shards)
    if marker.zero_stage == 3:
        # DeepSpeed's reader unpickles with weights_only=False: it sees the tag's files only once all are vetted
        vet_files(d)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(open(os.devnull, "w")):
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    files = sorted(d.glob("mp_rank_*_model_states.pt"))
    if len(files) < marker.tensor_parallel or not files:
        fail(f"{d} has {len(files)} model states files for tensor_parallel={marker.tensor_parallel}: the checkpoint "
             "is incomplete")
    return tp_merge_state_dicts([load_untrusted(f)["module"] for f in files[:marker.tensor_parallel]])


def _pipeline_file_ranks(name: str) -> tuple[int, int]:
    """(layer index, TP rank) of DeepSpeed's ``layer_XX-model_states.pt`` / ``layer_XX-model_YY-model_states.pt``."""
    parts = name.split("-")
    layer = int(parts[0].split("_")[1])
    return layer, (int(parts[1].split("_")[1]) if len(parts) == 3 else 0)


def export(run_dir, output, tag: str | None = None, dtype: str = "bf16", force: bool = False) -> dict:
    """Write an HF checkpoint (+ tokenizer) from a training checkpoint and verify it against the trained model:
    ``AutoModelForCausalLM`` reloads the export and its logits on a probe batch must match ours."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        fail(f"run directory {run_dir} does not exist: pass --run the run_dir of a training run")
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not force:
        fail(f"{output} already exists: choose another --output or pass --force to replace it")
    tag = tag or latest_tag(run_dir)
    if tag is None:
        fail(f"{run_dir} has no checkpoint yet: train first, or pass --tag")
    marker = read_marker(run_dir, tag)
    # transformers' modeling code loads only now (it takes seconds): the checks above answer a mistake at once
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.hf_io import save_hf_checkpoint

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    config = LlamaConfig.from_dict(marker.model_config)
    state = {k: v for k, v in read_model_state(run_dir, tag, marker).items() if not k.endswith("_extra_state")}
    model = LlamaForCausalLM(config, backend="torch", params_dtype=torch_dtype).eval()
    model.load_state_dict({k: v.to(torch_dtype) for k, v in state.items()}, strict=False)
    tokenizer = run_dir / "tokenizer"
    save_hf_checkpoint(model, output, dtype=torch_dtype, force=True,
                       tokenizer_dir=tokenizer if (tokenizer / "tokenizer_config.json").is_file() else None)
    # parity: the export, loaded by transformers alone, must compute what the trained weights compute
    probe = torch.randint(0, config.vocab_size, (2, min(64, config.max_position_embeddings)),
                          generator=torch.Generator().manual_seed(0))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    reloaded = AutoModelForCausalLM.from_pretrained(str(output), dtype=torch_dtype).eval()
    with torch.no_grad():
        ours = model(probe).logits.float()
        theirs = reloaded(probe).logits.float()
    err = (ours - theirs).abs().max().item()
    tolerance = 1e-4 if torch_dtype == torch.float32 else 2e-2 * max(1.0, ours.abs().max().item())
    if not err <= tolerance:
        shutil.rmtree(output, ignore_errors=True)
        fail(f"export check failed: logits of the exported model differ from the trained model's by {err:.3g} "
             f"(tolerance {tolerance:.3g}); the export was removed")
    return {"tag": tag, "step": marker.step, "output": str(output), "max_logit_diff": err, "dtype": dtype}


def import_hf(model_dir, run_dir, preset: str = "llmjp3-1.8b", force: bool = False) -> Path:
    """Start a run directory for continued pretraining from an HF Llama checkpoint: writes its config.yaml."""
    import yaml

    from llmjp_ds.config import merge, preset_dict
    from llmjp_ds.model.hf_io import read_hf_config
    from llmjp_ds.model.shapes import check_supported, rope_theta

    model_dir, run_dir = Path(model_dir).resolve(), Path(run_dir)
    base = preset_dict(preset)
    if not model_dir.is_dir():
        fail(f"model directory {model_dir} does not exist: pass --model the directory save_pretrained wrote "
             "(config.json + safetensors)")
    hf = read_hf_config(model_dir)
    check_supported(hf)
    if (run_dir / "config.yaml").exists() and not force:
        fail(f"{run_dir} already holds a run: choose another --run or pass --force")
    overrides = {"hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers,
                 "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads,
                 "ffn_hidden_size": hf.intermediate_size, "vocab_size": hf.vocab_size,
                 "seq_len": hf.max_position_embeddings, "rope_theta": rope_theta(hf), "rms_norm_eps": hf.rms_norm_eps}
    data = merge(base, {"run_dir": str(run_dir), "model": {
        "shape": "tiny", "overrides": overrides, "init_from_hf": str(model_dir)}})
    if (model_dir / "tokenizer_config.json").is_file():
        data.setdefault("data", {})["tokenizer"] = str(model_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(run_dir / "config.yaml", "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return run_dir / "config.yaml"


def cli_main(argv: list[str], verb: str = "export") -> int:
    if verb == "import-hf":
        p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}",
                                    description="start a run from a Hugging Face Llama checkpoint")
        p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
        p.add_argument("--run", required=True, help="run directory to create")
        p.add_argument("--preset", default="llmjp3-1.8b", help="run preset for optimizer/batch settings")
        p.add_argument("--force", action="store_true")
        a = p.parse_args(argv)
        path = import_hf(a.model, a.run, a.preset, a.force)
        print(f"wrote {path}; start training with: llmjp-ds train --config {path}")
        return 0
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description="export a checkpoint as a HF Llama model")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--output", required=True, help="output directory for the HF model")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    a = p.parse_args(argv)
    result = export(a.run, a.output, a.tag, a.dtype, a.force)
    print(f"exported {result['tag']} (step {result['step']}) to {result['output']} as {result['dtype']}; "
          f"AutoModelForCausalLM reload check passed (max |dlogit| {result['max_logit_diff']:.2e})")
    return 0
