"""Small filesystems the tests mount for themselves: a tmpfs of a given size, a bind mount of one (to unmount
lazily under a running training, as a lost network mount looks), and a filler that leaves a given number of bytes
free. Mounting needs root and mount(8); where it is not allowed the test is skipped with the reason
(``LLMJP_DS_TEST_NO_MOUNT=1`` forces that, to try the fallbacks)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def mount_refused() -> str | None:
    """Why this process cannot mount a filesystem (None: it can)."""
    if os.environ.get("LLMJP_DS_TEST_NO_MOUNT"):
        return "LLMJP_DS_TEST_NO_MOUNT is set"
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount(8) on this machine"
    return None


def mount_tmpfs(path: Path, options: str) -> str | None:
    """Mount a tmpfs at ``path`` (made if missing) with ``options`` (e.g. ``size=2m``); the reason it was not
    mounted, or None."""
    path.mkdir(parents=True, exist_ok=True)
    why = mount_refused()
    if why is None:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                              text=True)
        why = None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip()}"
    return why


def umount(path: Path, lazy: bool = False) -> None:
    subprocess.run(["umount", *(["-l"] if lazy else []), str(path)], capture_output=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` (``2m``) at ``path`` for the ``with`` block, unmounted after; the test is skipped with
    the reason where it cannot be mounted."""
    why = mount_tmpfs(path, f"size={size}")
    if why is not None:
        pytest.skip(f"no small filesystem of our own: {why}")
    try:
        yield path
    finally:
        umount(path)


def bind(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True, capture_output=True)


def resize(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the filesystem of directory ``path`` with a file ``path/.filler`` until at most ``leave`` bytes are
    free; returns the file (delete it to give the space back)."""
    filler = path / ".filler"
    chunk = b"\0" * (1 << 16)
    with open(filler, "ab", buffering=0) as f:
        while True:
            free = shutil.disk_usage(path).free
            if free <= leave:
                break
            try:
                f.write(chunk[:max(1, min(len(chunk), free - leave))])
            except OSError:
                break
    return filler
