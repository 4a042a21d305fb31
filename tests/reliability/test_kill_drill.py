"""kill -9 drill: SIGKILL training and preprocessing at random moments (seeded), resume each time.

Training (8 kills): during start-up, at a random moment after a step, while DeepSpeed writes a checkpoint (a
tag directory without its ``llmjp_ds.json`` marker is on disk), and right after ``latest`` moved. After every
kill ``latest`` must name a complete checkpoint whose DeepSpeed files load; the run that finally completes must
have logged exactly the losses of an uninterrupted run (fp32, one process: bit for bit).

Preprocess (4 kills): at random moments, the instant the ``.bin`` appears under its final name, and while
replacing an existing corpus with ``--force``. After every kill an ``.idx`` under its final name is either absent
or its pair reads back complete, byte for byte one of the complete outputs.

The seed is ``$LLMJP_DS_DRILL_SEED`` (default fixed): a failure message prints it and each kill's moment.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import (
    DRILL, DRILL_STEPS, Proc, assert_latest_complete, check_ok, events, latest_of, loss_trail, run, run_train,
    tag_step, train_argv, wait_for,
)

SEED = int(os.environ.get("LLMJP_DS_DRILL_SEED", "7"))


def _partial_tag(run_dir: Path, min_step: int) -> str | None:
    """A checkpoint directory of step >= min_step that DeepSpeed is writing (no marker yet)."""
    root = run_dir / "checkpoints"
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    for name in names:
        if name.startswith("step") and name[4:12].isdigit() and int(name[4:12]) >= min_step:
            d = root / name
            if d.is_dir() and not (d / "llmjp_ds.json").exists():
                return name
    return None


def _kill(mode: str, proc: Proc, run_dir: Path, start: int, rng: random.Random) -> str:
    """Wait for the moment ``mode`` names, SIGKILL the process group; return what the moment was."""
    room = DRILL_STEPS - 1 - start  # never let the run finish before the kill
    if mode == "startup" or room < 4:
        # start-up takes ~1 s forked from the suite's server (tests/forkserver.py), ~6 s in a fresh interpreter:
        # a kill at a random moment of its first second, or at its first step if that comes sooner
        delay = rng.uniform(0.05, 1.0)
        wait_for(lambda: time.monotonic() - proc.t0 >= delay or proc.steps_done() > start, proc, timeout=delay + 1)
        proc.kill()
        return f"at its first step (+{time.monotonic() - proc.t0:.2f}s)" if proc.steps_done() > start else \
            f"startup +{delay:.2f}s"
    if mode == "step":
        target = start + rng.randint(1, 2)
        delay = rng.uniform(0.0, 0.25)
        assert wait_for(lambda: proc.steps_done() >= target, proc), proc.output()[-2000:]
        time.sleep(delay)
        proc.kill()
        return f"{delay:.2f}s after step {target}"
    if mode == "latest":
        target = start + rng.randint(1, 2)
        assert wait_for(lambda: (t := latest_of(run_dir)) and tag_step(t) >= target, proc), proc.output()[-2000:]
        proc.kill()
        return f"right after latest moved to >= {target}"
    if mode == "saving":
        # once this process has logged start+2, its first save has pruned partial tags left by earlier kills
        target = start + rng.randint(3, 4)
        assert wait_for(lambda: proc.steps_done() >= start + 2, proc), proc.output()[-2000:]
        tag = wait_for(lambda: _partial_tag(run_dir, target), proc)
        assert tag, f"never saw a checkpoint being written\n{proc.output()[-2000:]}"
        proc.kill()
        partial = run_dir / "checkpoints" / tag
        state = "gone" if not partial.exists() else ",".join(sorted(os.listdir(partial))) or "empty"
        assert latest_of(run_dir) != tag or (partial / "llmjp_ds.json").is_file()
        return f"while saving {tag} (on disk: {state})"
    raise ValueError(mode)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_kill_9_during_training_and_saves_then_resume_exactly(baseline, tmp_path):
    _, expected = baseline
    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    modes = ["saving", "saving", "latest", "latest", "step", "step", "step", "startup"]
    rng.shuffle(modes)
    story, resumed_from = [f"seed {SEED}"], []
    for mode in modes:
        start_tag = latest_of(run_dir)
        start = tag_step(start_tag) if start_tag else 0
        if start_tag:
            resumed_from.append(start)
        proc = Proc(train_argv(run_dir, DRILL))
        moment = _kill(mode, proc, run_dir, start, rng)
        assert proc.p.returncode == -9, f"{moment}: the run was not killed (exit {proc.p.returncode})\n" + \
            proc.output()[-2000:]
        tag = assert_latest_complete(run_dir)
        story.append(f"{mode}: resumed from {start}, killed {moment}; latest -> {tag}")
    end_tag = latest_of(run_dir)
    if end_tag:
        resumed_from.append(tag_step(end_tag))
    final = run_train(run_dir, DRILL)
    check_ok(final)
    story = "\n".join(story)
    print(story)
    assert len(story.splitlines()) - 1 == 8, story
    # the completed run logged exactly the uninterrupted losses, step by step
    assert loss_trail(run_dir) == expected, story
    # every restart that got as far as logging resumed from the checkpoint latest named when it started (a
    # restart killed during start-up logs nothing), the last one included
    resumes = [e["step"] for e in events(run_dir, "resume")]
    assert set(resumes) <= set(resumed_from) and resumes[-1] == resumed_from[-1], (resumes, story)
    # and the run directory holds only complete checkpoints (keep_last=2), no debris of the kills
    root = run_dir / "checkpoints"
    tags = sorted(d.name for d in root.iterdir() if d.is_dir())
    assert len(tags) == 2 and all((root / t / "llmjp_ds.json").is_file() for t in tags), (tags, story)
    assert latest_of(run_dir) == f"step{DRILL_STEPS:08d}"
    assert not [f for f in os.listdir(root) if f.endswith(".tmp")], story


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_9_while_a_marked_tag_is_saved_again(baseline, tmp_path):
    """A kill between a checkpoint's marker and the move of ``latest`` leaves a complete tag newer than latest;
    the resumed run saves that tag again, in place. Killed during the rewrite, the tag must not keep a marker
    over half-rewritten files (``export --tag`` and the FP8 rollback trust markers, not ``latest``)."""
    _, expected = baseline
    run_dir = tmp_path / "run"
    shutil.copytree(baseline[0], run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step00000029")  # 30 has its marker, latest did not move
    tag_dir = run_dir / "checkpoints" / f"step{DRILL_STEPS:08d}"
    files = {f: f.stat().st_mtime_ns for f in tag_dir.glob("*.pt")}

    def rewriting():
        try:
            return not (tag_dir / "llmjp_ds.json").exists() or any(f.stat().st_mtime_ns != t for f, t in files.items())
        except FileNotFoundError:
            return True

    proc = Proc(train_argv(run_dir, DRILL))
    assert wait_for(rewriting, proc, interval=0.0002), proc.output()[-2000:]
    proc.kill()
    assert assert_latest_complete(run_dir) == "step00000029"  # and every tag that has a marker loads
    check_ok(run_train(run_dir, DRILL))
    assert loss_trail(run_dir) == expected


# --- preprocess --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory) -> Path:
    """~36 MB of jsonl (the bundled corpus, repeated): a couple of seconds of preprocessing on 2 cores."""
    from llmjp_ds.data import bundled_corpus_files

    lines = []
    for path in bundled_corpus_files():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines += [line for line in f if line.strip()]
    out = tmp_path_factory.mktemp("pp") / "big.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        size = 0
        while size < 36 << 20:
            for line in lines:
                f.write(line)
                size += len(line)
    return out


def _preprocess_argv(inputs, tokenizer, prefix, *more) -> list[str]:
    return [sys.executable, "-m", "llmjp_ds.cli", "preprocess", "--input", *map(str, inputs), "--tokenizer",
            str(tokenizer), "--output-prefix", str(prefix), "--workers", "2", *more]


def _pair(prefix: Path) -> tuple[bytes, bytes] | None:
    bin_, idx = Path(f"{prefix}_text_document.bin"), Path(f"{prefix}_text_document.idx")
    if not idx.exists():
        return None
    from llmjp_ds.data.indexed import IndexedDataset

    ds = IndexedDataset(f"{prefix}_text_document")  # structure, sizes and pointers all check out
    assert ds.num_documents > 0 and len(ds.document(ds.num_documents - 1)) > 0
    return bin_.read_bytes(), idx.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_during_preprocess_leaves_no_half_written_corpus(bundled, big_jsonl, tmp_path):
    _, tokenizer = bundled
    rng = random.Random(SEED + 1)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    ref, old = tmp_path / "ref", tmp_path / "old"
    t0 = time.monotonic()
    check_ok(run(_preprocess_argv([big_jsonl], tokenizer, ref)))
    duration = time.monotonic() - t0
    check_ok(run(_preprocess_argv([small], tokenizer, old)))
    complete = {_pair(ref), _pair(old)}
    complete_bins = {b for b, _ in complete}
    out = tmp_path / "out"
    story = [f"seed {SEED + 1}, a full preprocess takes {duration:.1f}s"]
    for mode in ("early", "late", "bin-appears", "force-over-old"):
        extra = []
        if mode == "bin-appears":  # start clean, so the .bin's appearance is this run's rename
            for suffix in (".bin", ".idx"):
                Path(f"{out}_text_document{suffix}").unlink(missing_ok=True)
        elif mode == "force-over-old":  # a complete older corpus under the final names, replaced with --force
            for suffix in (".bin", ".idx"):
                Path(f"{out}_text_document{suffix}").write_bytes(Path(f"{old}_text_document{suffix}").read_bytes())
            extra = ["--force"]
        elif Path(f"{out}_text_document.bin").exists() or Path(f"{out}_text_document.idx").exists():
            extra = ["--force"]  # what a user does after a killed run left a .bin without its .idx
        proc = Proc(_preprocess_argv([big_jsonl], tokenizer, out, *extra))
        if mode == "bin-appears":
            wait_for(lambda: Path(f"{out}_text_document.bin").exists(), proc, timeout=60)
            moment = "the instant the .bin appeared"
        else:
            low, high = (0.85, 1.05) if mode == "late" else (0.15, 0.85)
            delay = rng.uniform(low * duration, high * duration)
            wait_for(lambda: time.monotonic() - proc.t0 >= delay, proc, timeout=delay + 1)
            moment = f"+{delay:.2f}s"
        finished = not proc.alive()
        proc.kill()
        pair = _pair(out)
        story.append(f"{mode}{' ' + ' '.join(extra) if extra else ''}: killed {moment}"
                     f"{' (had already finished)' if finished else ''}; .idx {'present' if pair else 'absent'}, .bin "
                     f"{'present' if Path(f'{out}_text_document.bin').exists() else 'absent'}")
        assert pair is None or pair in complete, "\n".join(story)
        lone_bin = Path(f"{out}_text_document.bin")
        if pair is None and lone_bin.exists():  # renamed in place only when complete: some run's whole .bin
            assert lone_bin.read_bytes() in complete_bins, "\n".join(story)
        leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("out_text_document") and
                     p.suffix not in (".bin", ".idx", ".json")]
        assert not leftovers, leftovers
        # the summary is renamed into place after the .bin and before the .idx: never without its .bin
        assert not Path(f"{out}_text_document.json").exists() or lone_bin.exists(), "\n".join(story)
    story = "\n".join(story)
    print(story)
    assert sum("already finished" not in s for s in story.splitlines()[1:]) >= 3, story
    check_ok(run(_preprocess_argv([big_jsonl], tokenizer, out, "--force")))
    assert _pair(out) == _pair(ref), story
