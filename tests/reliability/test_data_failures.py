"""Data commands under a resource limit, and the data cases of the catalogue leaving nothing behind.

``preprocess`` under a file-size limit (``RLIMIT_FSIZE``: the write fails with EFBIG, as ENOSPC on a full disk):
one line naming the output, the reason and the free space; no temp file, no partial corpus; an existing corpus
that ``--force`` would replace is untouched. The catalogue's harness checks that files that existed are unchanged;
here the data cases that start no training run again against their own directory, to check that a failing
command also adds nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import resource
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.reliability import cases_data
from tests.reliability.conftest import REPO, subprocess_env
from tests.reliability.test_bad_inputs import _files, check_one_line_error


@pytest.fixture(scope="module")
def tok(bundled) -> Path:
    """The bundled corpus's tokenizer, the one the catalogue's good corpus is written with."""
    return bundled[1]


def _limited(max_bytes: int):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return limit


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])
def test_file_size_limit_during_preprocess(tmp_path, tok, workers):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"文書 {i}: the quick brown fox jumps. " * 40}) + "\n"
                           for i in range(400)))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "llmjp_ds.cli", "preprocess", "--input", str(src), "--tokenizer", str(tok),
            "--output-prefix", str(out), "--workers", str(workers)]
    small = tmp_path / "small.jsonl"  # an existing corpus, small enough for the limit, that --force must keep
    small.write_text('{"text": "keep me"}\n')
    first = subprocess.run([*argv[:5], str(small), *argv[6:]], capture_output=True, text=True, timeout=120,
                           env=subprocess_env(), cwd=REPO)
    assert first.returncode == 0, first.stderr
    before = _files(tmp_path)
    result = subprocess.run([*argv, "--force"], capture_output=True, text=True, timeout=150, env=subprocess_env(),
                            cwd=REPO, preexec_fn=_limited(16 * 1024))
    line = check_one_line_error(result, (f"cannot write {out}_text_document.bin/.idx: File too large (EFBIG); ",
                                         " free there: free space (or raise the file-size limit or quota)",
                                         "nothing was written"), 0, trains=False)
    assert _files(tmp_path) == before, "an existing file changed, or a temp/partial file was left"
    print(line)


def _ctx(root: Path, tok: Path) -> SimpleNamespace:
    cases_data.good_corpus(root, tok)
    ctx = SimpleNamespace(tmp=root, tok=tok, run=root / "run")
    cases_data.prepare(ctx)
    return ctx


# the data cases that are not a training start (a start builds index caches; the catalogue checks its run_dir)
COMMANDS = [c for c in cases_data.CASES if not (c.trains or c.after_start)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failing_data_cases_leave_nothing_behind(tmp_path, tok):
    """Every data case: one line, and the directory holds exactly what it held before (no out_x*, no .tmp, no
    tokenizer or plot directory or file)."""
    ctx = _ctx(tmp_path, tok)
    before = _files(tmp_path)
    names = sorted(str(p) for p in tmp_path.rglob("*"))

    def one(case):
        result = subprocess.run([sys.executable, *case.argv(ctx)], capture_output=True, text=True, timeout=120,
                                env=subprocess_env(**case.env), cwd=REPO)
        try:
            check_one_line_error(result, case.expect, 0, trains=False)
        except AssertionError as exc:
            return f"{case.id}: {exc}"
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(one, COMMANDS) if f]
    assert not failures, "\n\n".join(failures)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == names, "a failing case left something behind"
    assert _files(tmp_path) == before
    assert len(COMMANDS) >= 12
