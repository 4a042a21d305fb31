"""Reading a checkpoint executes no pickled code (``llmjp_ds.checkpoint.safe_load``).

A checkpoint directory from elsewhere (a collaborator's bucket, a downloaded run) is planted with a file whose
unpickling creates a marker file: each test first shows that a plain ``torch.load(weights_only=False)`` of it
does create the marker (so the test can fail), then ``llmjp-ds export`` of the run must refuse it with one line
naming the file and the offending global, no traceback, no marker, no output directory. The layouts: a
1-process (ZeRO-1) checkpoint, a pipeline one (``layer_XX-model_states.pt``) and a ZeRO-3 one, whose files
DeepSpeed's own reader unpickles with ``weights_only=False`` once ours has vetted them all. And the converse:
untouched checkpoints of the three layouts (the 1-process one after an emulated FP8 flip, so its
``_extra_state`` holds float tensors) read through the safe loader alone, and export.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.reliability.cases_checkpoint import Payload, remanifest
from tests.reliability.conftest import TINY, check_ok, latest_of, run, run_train, subprocess_env, train_argv

STEPS = ["train.steps=2"]
FP8_FLIP = [("precision.phases=[{precision: bf16}, {precision: fp8, start_step: 2, recipe: delayed, "
             "amax_history_len: 4}]"), "precision.emulate_fp8=true"]
SYSTEM = f"{os.system.__module__}.system"  # how pickle names os.system: posix.system here


def plant(path: Path, marker: Path, how: str, edit, manifest: bool = True) -> None:
    """Rewrite the real checkpoint file ``path`` with a payload put in by ``edit(state, payload)``, its manifest
    entry with it (an attacker who can write the file can write the manifest: the checksum does not stop them,
    the safe reader must), and show that the file is live: a plain ``torch.load`` runs the payload."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own run's file
    edit(state, Payload(marker, how))
    torch.save(state, path)
    if manifest:
        remanifest(path.parent, path.name)
    assert not marker.exists()
    torch.load(path, map_location="cpu", weights_only=False)
    assert marker.exists(), "the planted file does not run its payload: this test would prove nothing"
    marker.unlink()


def export_is_refused(run_dir: Path, planted: Path, offender: str, marker: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run([sys.executable, "-m", "llmjp_ds.cli", "export", "--run", str(run_dir), "--output", str(out),
                  "--dtype", "fp32"], timeout=180)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, result.stdout[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one error line:\n{result.stderr}"
    assert "Traceback" not in result.stdout + result.stderr
    assert str(planted) in lines[0] and f"holds {offender}," in lines[0] and "weights_only=True" in lines[0], lines
    assert not marker.exists(), "unpickling the planted file ran its payload"
    assert not out.exists()


def copy_run(run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run (the module's runs stay untouched) and its latest tag's directory."""
    copy = tmp_path / "downloaded-run"
    shutil.copytree(run_dir, copy)
    return copy, copy / "checkpoints" / latest_of(copy)


def two_processes(run_dir: Path, *sets: str):
    """(argv, env) of a 2-rank torchrun training."""
    from tests.launch import free_port

    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            *train_argv(run_dir, [*TINY, *STEPS, *sets])[1:]]  # ... -m llmjp_ds.train --set ...
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "llmjp-ds" / "torch_extensions"))
    return argv, subprocess_env(TORCH_EXTENSIONS_DIR=ext)


def train_two_processes(run_dir: Path, *sets: str) -> None:
    argv, env = two_processes(run_dir, *sets)
    check_ok(run(argv, env=env, timeout=300))


@pytest.fixture(scope="module")
def single_run(bundled, tmp_path_factory) -> Path:
    """1 process (ZeRO-1), 2 steps, an emulated FP8 flip at step 1: the checkpoint holds FP8 _extra_state."""
    run_dir = tmp_path_factory.mktemp("untrusted") / "single"
    check_ok(run_train(run_dir, [*TINY, *STEPS, *FP8_FLIP]))
    return run_dir


@pytest.fixture(scope="module")
def pipeline_run(bundled, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("untrusted") / "pp2"
    train_two_processes(run_dir, "parallel.zero_stage=1", "parallel.pipeline_stages=2")
    return run_dir


@pytest.fixture(scope="module")
def zero3_run(bundled, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("untrusted") / "zero3"
    train_two_processes(run_dir, "parallel.zero_stage=3")
    return run_dir


# --- the loader alone ----------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["zip", "zip-protocol-4", "legacy"])
def test_the_loader_refuses_a_payload_in_any_file_format(fmt, tmp_path):
    from llmjp_ds.errors import UserError
    from llmjp_ds.checkpoint.safe_load import load_untrusted

    marker, path = tmp_path / "ran", tmp_path / "model_states.pt"
    kwargs = {"zip": {}, "zip-protocol-4": {"pickle_protocol": 4},
              "legacy": {"_use_new_zipfile_serialization": False}}[fmt]
    torch.save({"module": {"w": torch.ones(3)}, "extra": [Payload(marker, "system")]}, path, **kwargs)
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UserError) as caught:
        load_untrusted(path)
    assert str(caught.value).startswith(f"{path} holds {SYSTEM}, ") and "\n" not in str(caught.value)
    assert not marker.exists()
    # the same data without the payload loads (a protocol-4 file is refused whatever it holds: torch's
    # weights_only unpickler reads protocol 2, which torch.save and DeepSpeed write)
    torch.save({"module": {"w": torch.ones(3)}, "extra": [1, "a", (2.0,)]}, path, **kwargs)
    if fmt == "zip-protocol-4":
        with pytest.raises(UserError, match="cannot be read with weights_only=True"):
            load_untrusted(path)
    else:
        assert torch.equal(load_untrusted(path)["module"]["w"], torch.ones(3))


# --- export of a planted checkpoint ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_export_refuses_a_planted_model_states_file(single_run, tmp_path):
    run_dir, tag_dir = copy_run(single_run, tmp_path)
    planted, marker = tag_dir / "mp_rank_00_model_states.pt", tmp_path / "ran-zero1"

    def edit(state, payload):  # where TE's pickled extra state lives
        state["module"]["model.layers.0.self_attention.proj._extra_state"] = payload

    plant(planted, marker, "system", edit)
    export_is_refused(run_dir, planted, SYSTEM, marker, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_refuses_a_planted_pipeline_layer_file(pipeline_run, tmp_path):
    run_dir, tag_dir = copy_run(pipeline_run, tmp_path)
    planted, marker = tag_dir / "layer_02-model_states.pt", tmp_path / "ran-pp"

    def edit(state, payload):
        state["self_attention.proj._extra_state"] = payload

    plant(planted, marker, "exec", edit)
    export_is_refused(run_dir, planted, "builtins.exec", marker, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_vets_every_zero3_file_before_deepspeed_reads_it(zero3_run, tmp_path):
    """The payload sits in rank 1's optimizer states, a file only DeepSpeed's zero_to_fp32 reads (with
    weights_only=False): the vetting must refuse it before that reader starts (it would print its progress
    bars on stderr)."""
    run_dir, tag_dir = copy_run(zero3_run, tmp_path)
    planted, marker = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tmp_path / "ran-zero3"

    def edit(state, payload):
        state["optimizer_state_dict"]["loss_scaler"] = payload

    plant(planted, marker, "system", edit)
    export_is_refused(run_dir, planted, SYSTEM, marker, tmp_path)


# --- resume of a planted checkpoint: the files DeepSpeed's engine and the reshape read -----------------------
# (the 1-process model and optimizer states, and TE's extra state in them, are cases of the bad-input catalogue)

@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_refuses_a_planted_pipeline_layer_file(pipeline_run, tmp_path):
    """DeepSpeed's pipeline engine reads each stage's layer files through its checkpoint engine: ours."""
    run_dir, tag_dir = copy_run(pipeline_run, tmp_path)
    planted, marker = tag_dir / "layer_02-model_states.pt", tmp_path / "ran-pp-resume"
    plant(planted, marker, "system", lambda state, payload: state.__setitem__("self_attention.proj._extra_state",
                                                                             payload))
    argv, env = two_processes(run_dir, "parallel.zero_stage=1", "parallel.pipeline_stages=2", "train.steps=4")
    result = run(argv, env=env, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: [rank")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert f"{planted} holds {SYSTEM}, which loading would have to execute" in errors[0], errors
    assert not marker.exists(), "resuming ran the planted payload"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_refuses_a_planted_layout_free_file(pipeline_run, tmp_path):
    """A resume on another layout converts the checkpoint once into ``<tag>/layout-free/`` and reads it back on
    later resumes: a file planted there is refused as well."""
    run_dir, tag_dir = copy_run(pipeline_run, tmp_path)
    sets = [*TINY, "train.steps=3", "checkpoint.interval=0", "checkpoint.save_at_end=false"]
    check_ok(run_train(run_dir, sets))  # PP2 -> one process: converts, resumes, saves nothing
    planted, marker = tag_dir / "layout-free" / "_extra_state.pt", tmp_path / "ran-reshape"
    plant(planted, marker, "exec", lambda state, payload: state.__setitem__("step", payload), manifest=False)
    result = run_train(run_dir, sets)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: {planted} holds builtins.exec, which loading would have to execute"), lines
    assert not marker.exists(), "resuming ran the planted payload"


# --- untouched checkpoints -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_checkpoints_read_through_the_safe_loader(single_run, pipeline_run, zero3_run, monkeypatch):
    """Every layout's model state reads with weights_only=True and the allowlist; on ZeRO-3 DeepSpeed's own
    weights_only=False reads come only after every file of the tag was read safely. Every file of every tag
    (optimizer states too: the DeepSpeed types of the allowlist) passes the vetting."""
    from llmjp_ds.checkpoint import read_marker, read_model_state
    from llmjp_ds.checkpoint.safe_load import vet_files

    loads = []
    real_load = torch.load

    def spy(f, *args, **kwargs):
        loads.append((Path(f).name, kwargs.get("weights_only")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    for run_dir in (single_run, pipeline_run, zero3_run):
        tag = latest_of(run_dir)
        tag_dir = run_dir / "checkpoints" / tag
        loads.clear()
        state = read_model_state(run_dir, tag, read_marker(run_dir, tag))
        assert state and all(isinstance(v, torch.Tensor) for v in state.values())
        if run_dir is zero3_run:
            first_unsafe = [w for _, w in loads].index(False)
            vetted = {name for name, w in loads[:first_unsafe] if w is True}
            assert vetted == {p.name for p in tag_dir.glob("*.pt")}, loads
        else:
            assert loads and all(w is True for _, w in loads), loads
        assert vet_files(tag_dir) == sorted(tag_dir.glob("*.pt"))
        if run_dir is single_run:  # after the emulated FP8 flip: amax/scale state as float tensors
            extra = [v for k, v in state.items() if k.endswith("_extra_state") and v.numel()]
            assert extra and all(v.is_floating_point() for v in extra)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_export_of_an_untouched_checkpoint_still_works(single_run, tmp_path):
    out = tmp_path / "hf"
    result = run([sys.executable, "-m", "llmjp_ds.cli", "export", "--run", str(single_run), "--output", str(out),
                  "--dtype", "fp32"], timeout=180)
    check_ok(result)
    assert "AutoModelForCausalLM reload check passed" in result.stdout, result.stdout
    assert (out / "config.json").is_file()
