"""Atomic writes: a file or directory appears under its final name complete, or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from llmjp_ds.errors import fail


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writable_parent(path: Path) -> Path:
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create {parent}: {exc.strerror}; choose a writable location")
    if not os.access(parent, os.W_OK):
        fail(f"{parent} is not writable: choose another output location or fix its permissions")
    return parent


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator:
    """Open a temp file beside ``path``; on success fsync and rename it over ``path``; on error remove it."""
    path = Path(path)
    parent = _writable_parent(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success it replaces ``path`` (only with ``force`` if ``path``
    exists and is not empty). On error the temp directory is removed and ``path`` is untouched."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not force:
        fail(f"{path} already exists: choose another output or pass --force to replace it")
    parent = _writable_parent(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
