"""Atomic writes: a file or directory appears under its final name complete, or not at all.

Used by every writer of lasting data: corpora and index caches, tokenizers, checkpoints' markers and
``latest``, and Hugging Face exports. Temp files live beside their target (same filesystem, so the final
``os.replace`` is atomic) under hidden names that pruning recognises. A write that fails (a full disk, a quota, a
file-size limit, an I/O error) is said in one line naming the path and the space left there
(:func:`one_line_write_errors`), what was half written removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from llmjp_ds.errors import UserError, fail

# a library's words for a write the OS refused: safetensors ("... (os error 28)"), torch's zip writer ("unexpected
# pos 576 vs 534" once part of a record was not written)
_OS_ERROR = re.compile(r"os error (\d+)|\[Errno (\d+)\]")  # shutil.Error lists its files' OSErrors as text
_CUT_SHORT = ("unexpected pos", "PytorchStreamWriter failed writing")


def free_space(path: str | Path) -> str:
    """The space left on the filesystem of ``path`` (or of its nearest existing parent), in words: ``4.2 MiB free``."""
    for d in [Path(path), *Path(path).parents]:
        try:
            free = shutil.disk_usage(d).free
        except OSError:
            continue
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if free >= size:
                return f"{free / size:.1f} {unit} free"
        return f"{free} bytes free"
    return "free space unknown"


def write_failure(exc: BaseException) -> str | None:
    """Why a write failed, in words (``No space left on device (ENOSPC)``), when ``exc`` is a failed write: an
    OSError, or a library's error around one (safetensors', torch's zip writer's); None for anything else."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:
        found = _OS_ERROR.search(str(exc))
        if found:
            code = int(found.group(1) or found.group(2))
        elif any(text in str(exc) for text in _CUT_SHORT):
            return "a write was cut short"
        elif not isinstance(exc, OSError):
            return None
    if code is None:
        return str(exc).strip() or type(exc).__name__
    name = errno.errorcode.get(code, "")
    return f"{os.strerror(code)}{f' ({name})' if name else ''}"


@contextlib.contextmanager
def one_line_write_errors(path: str | Path, advice: str) -> Iterator[None]:
    """Turn a failed write inside into one line: ``cannot write PATH (why; N free there): advice``. Errors that
    are not failed writes (and one-line errors raised inside) pass through as they are."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        why = write_failure(exc)
        if why is None:
            raise
        fail(f"cannot write {path} ({why}; {free_space(Path(path).parent)} there): {advice}")


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


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb", make_parents: bool = True) -> Iterator:
    """Open a temp file beside ``path``; on success fsync and rename it over ``path``; on error remove it.
    ``make_parents=False``: the directory must exist (a write into a run's checkpoint never makes a tree of its own
    where the run's directory has gone)."""
    path = Path(path)
    parent = ensure_writable_dir(path.parent) if make_parents else path.parent
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
    parent = ensure_writable_dir(path.parent)
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


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)
