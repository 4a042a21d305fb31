"""One owner per run directory: an ``fcntl.flock`` on ``<run_dir>/.llmjp_ds.lock``, held for the life of the
training process and released by the kernel on any exit, kill -9 included.

Rank 0 of a job takes the lock (exclusive) before anything is written and records itself in the file: host,
pid, start time and the job's rendezvous address (``MASTER_ADDR:MASTER_PORT``, which no two live jobs share).
The other ranks, which must see the same directory, only look: a lock held by a process of another job ends
them too, so a second job's ranks on other nodes do not wait for a rendezvous that will never come. flock
works across nodes on NFS (Linux emulates it with POSIX locks) and on Lustre mounted with ``-o flock``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from llmjp_ds.errors import fail

LOCK = ".llmjp_ds.lock"


def job_id() -> str | None:
    """The rendezvous address this process's job uses (None for a lone process, which picks its own)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ and "WORLD_SIZE" in os.environ:
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return None


def _holder(path: Path, tries: int = 20) -> dict:
    """What the lock file says of its holder (retried briefly: the holder writes it just after locking)."""
    info: dict = {}
    for _ in range(tries):
        try:
            info = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if info.get("pid"):
            return info
        time.sleep(0.1)
    return info


def _refuse(run_dir: Path, info: dict, what: str):
    who = (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')}"
           if info else "a process that left no record")
    fail(f"run_dir {run_dir} is in use by another {what} ({who}): wait for it to end, stop it, or choose "
         "another run_dir (two trainings must never share one)")


class RunDirLock:
    """The exclusive lock of one run directory, taken by :meth:`acquire`; the object keeps the file open."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / LOCK
        self._fd: int | None = None

    def acquire(self, what: str = "training") -> "RunDirLock":
        """Take the lock (creating the run directory) or fail with one line naming the holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            _refuse(self.run_dir, _holder(self.path), what)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "what": what,
                  "started": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)  # in place: replacing the file would give the next process another inode to lock
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def check_peer(self) -> None:
        """On a rank other than 0: fail if the run directory is held by a process of another job (free, it is
        this job's rank 0 that takes it next)."""
        info = _held_by(self.path)
        if info is not None and (info.get("job") is None or info.get("job") != job_id()):
            _refuse(self.run_dir, info, info.get("what", "training"))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _held_by(path: Path) -> dict | None:
    """What the lock file at ``path`` says of its holder while a live process holds it; None when none does."""
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError:
        return _holder(path)
    finally:
        os.close(fd)


def refuse_if_held(run_dir, what: str = "training") -> None:
    """Fail if a live process holds ``run_dir``'s lock (a command that must not write under a training)."""
    info = _held_by(Path(run_dir).resolve() / LOCK)
    if info is not None:
        _refuse(Path(run_dir).resolve(), info, info.get("what", what))
