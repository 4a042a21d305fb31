"""Write-then-rename helpers: an output appears under its final name complete, or not at all.

Kept inside ``llmjp_ds.data`` so that the data layer (preprocess, index caches) has no dependency on the trainer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from llmjp_ds.errors import fail


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def ensure_writable_dir(path: str | Path, what: str = "output") -> Path:
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create {what} directory {path}: {exc.strerror}; choose a writable location")
    if not os.access(path, os.W_OK):
        fail(f"{what} directory {path} is not writable: choose another location or fix its permissions")
    return path


def temp_path_beside(path: str | Path) -> Path:
    """A fresh, hidden file name in the directory of ``path`` (same filesystem, so ``os.replace`` is atomic)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def remove_quietly(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if Path(path).is_dir() and not Path(path).is_symlink():
            shutil.rmtree(path)
        else:
            os.unlink(path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = temp_path_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        remove_quietly(tmp)
        raise
