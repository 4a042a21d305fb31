"""One owner per run directory: an ``fcntl.flock`` on ``<run_dir>/.llmjp_ds.lock``, held for the life of the
training process and released by the kernel on any exit, kill -9 included.

Rank 0 of a job takes the lock (exclusive) before anything is written and records itself in the file: host,
pid, start time and the job's rendezvous address (``MASTER_ADDR:MASTER_PORT``, which no two live jobs share).
The other ranks, which must see the same directory, only look: a lock held by a process of another job ends
them too, so a second job's ranks on other nodes do not wait for a rendezvous that will never come. flock
works across nodes on NFS (Linux emulates it with POSIX locks) and on Lustre mounted with ``-o flock``.

A holder that is asked to stop (a stop signal; its save then has ``checkpoint.grace_seconds`` at most) writes
``<run_dir>/.llmjp_ds.stopping`` (its owner record, the reason, when, the grace time; replaced atomically), so a
relaunch refused meanwhile says how long to wait. ``--wait-for-run-dir SECONDS`` makes a relaunch poll for the
lock instead of ending at once (:meth:`RunDirLock.acquire`, :meth:`RunDirLock.check_peer`).

A run also checks, before each checkpoint and each metrics write, that its ``run_dir`` is still the directory it
locked (:meth:`RunDirLock.check_in_place`: the lock file at its path is the file it holds, by device and inode), so
a filesystem unmounted under it (lazily, as a lost network mount is) or a directory moved or removed ends the run
with one line instead of a run that goes on writing into whatever now sits at that path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from llmjp_ds.errors import UserError, fail
from llmjp_ds.io_utils import free_space, write_failure

LOCK = ".llmjp_ds.lock"
STOPPING = ".llmjp_ds.stopping"
POLL_S = 0.5  # how often a relaunch that waits for the run directory tries again
SKEW_S = 10  # added to a suggested wait: the holder's clock (another node) may differ a little from ours
# how long another job's record must stand in a held lock file before a rank believes it: this job's rank 0 takes
# the lock first and replaces the record of the run directory's last owner just after (a resume, a copied run)
SETTLE_S = 5.0


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


def _stopping(run_dir: Path, info: dict) -> dict | None:
    """The holder's stopping record, if the holder ``info`` wrote one (a stale one of an earlier owner: None)."""
    try:
        stop = json.loads((run_dir / STOPPING).read_text())
    except (OSError, ValueError):
        return None
    same = all(stop.get(k) == info.get(k) for k in ("pid", "host", "token"))
    return stop if same and isinstance(stop.get("at"), (int, float)) else None


def _in_use(run_dir: Path, info: dict, what: str, waited: float = 0.0) -> tuple[str, int | None]:
    """``run_dir ... is in use by another <what> (<holder>)``, and ``which is stopping (...)`` if the holder is;
    with the seconds its save may still take (None: it is not stopping)."""
    who = (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')}"
           if info else "a process that left no record")
    head = f"run_dir {run_dir} is in use by another {what} ({who})" + (f" (waited {waited:g} s)" if waited else "")
    stop = _stopping(run_dir, info) if info else None
    if stop is None:
        return head, None
    left = max(0, math.ceil(stop["at"] + float(stop.get("grace_seconds", 0)) - time.time()))
    at = datetime.fromtimestamp(stop["at"]).strftime("%H:%M:%S")
    return (f"{head}, which is stopping ({stop.get('reason', 'a stop request')} at {at}; its save has at most {left} "
            "s left of checkpoint.grace_seconds)"), left


def _refuse(run_dir: Path, info: dict, what: str, relaunch: bool = False, waited: float = 0.0):
    """Fail naming the holder; ``relaunch``: the refused command is a training, whose relaunch can wait."""
    head, left = _in_use(run_dir, info, what, waited)
    if left is not None:
        fail(f"{head}: " + (f"relaunch with --wait-for-run-dir {left + SKEW_S} to wait for it" if relaunch else
                            "run this again once it has ended"))
    wait = "wait for it to end (or relaunch with --wait-for-run-dir SECONDS)" if relaunch else "wait for it to end"
    fail(f"{head}: {wait}, stop it, or choose another run_dir (two trainings must never share one)")


def _tell_waiting(run_dir: Path, info: dict, what: str, wait_s: float) -> None:
    """The one line a relaunch prints when it starts to wait for the run directory."""
    rank = os.environ.get("RANK", "0")
    print(f"[llmjp-ds] {'' if rank == '0' else f'[rank {rank}] '}{_in_use(run_dir, info, what)[0]}: waiting up to "
          f"{wait_s:g} s for it to end (--wait-for-run-dir)", flush=True)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False


class RunDirLock:
    """The exclusive lock of one run directory, taken by :meth:`acquire`; the object keeps the file open."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / LOCK
        self._fd: int | None = None
        self.record: dict = {}
        self.waited = False  # it waited for another holder (whose last save may have moved `latest`)
        self.found: set[str] | None = None  # what the run directory held when acquired (None: it did not exist)
        self._identity: tuple[int, int] | None = None  # (device, inode) of the lock file this run locked

    def acquire(self, what: str = "training", wait_s: float = 0.0) -> "RunDirLock":
        """Take the lock (creating the run directory) or fail with one line naming the holder; ``wait_s``: while
        another process holds it, try again every :data:`POLL_S` for up to that long first (saying so once)."""
        self.found = set(os.listdir(self.run_dir)) if self.run_dir.is_dir() else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, told = time.monotonic() + wait_s, False
        while not _try_lock(fd):
            if time.monotonic() >= deadline:
                os.close(fd)
                _refuse(self.run_dir, _holder(self.path), what, relaunch=what == "training", waited=wait_s)
            if not told:
                _tell_waiting(self.run_dir, _holder(self.path), what, wait_s)
                told = self.waited = True
            time.sleep(POLL_S)
        # token: tells this owner's stopping record from an earlier owner's with the same pid and second
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "what": what,
                       "started": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
                       "token": os.urandom(8).hex()}
        try:
            os.ftruncate(fd, 0)  # in place: replacing the file would give the next process another inode to lock
            os.pwrite(fd, json.dumps(self.record).encode(), 0)
            os.fsync(fd)
        except OSError as exc:  # a full disk: the directory left as it was found
            os.close(fd)
            if self.found is None or LOCK not in self.found:
                self.path.unlink(missing_ok=True)
            if self.found is None:
                self.run_dir.rmdir()
            fail(f"cannot write {self.path} ({write_failure(exc)}; {free_space(self.run_dir)} there): free space "
                 "or choose another run_dir, then start again")
        self._fd = fd
        self._identity = _identity(os.fstat(fd))
        (self.run_dir / STOPPING).unlink(missing_ok=True)  # an earlier owner's, read by nobody now
        return self

    def check_peer(self, wait_s: float = 0.0) -> None:
        """On a rank other than 0: fail if the run directory is held by a process of another job (free, it is
        this job's rank 0 that takes it next); ``wait_s``: wait for that process to end first, as :meth:`acquire`.
        A held lock whose record names another job counts once the record has stood for :data:`SETTLE_S`: until
        then it may be the last owner's, which this job's rank 0 has locked and not yet replaced."""
        deadline, told = time.monotonic() + wait_s, False
        seen, since = None, 0.0
        while True:
            info = _held_by(self.path)
            if info is None or (info.get("job") is not None and info.get("job") == job_id()):
                return
            if info != seen:
                seen, since = info, time.monotonic()
            if time.monotonic() - since < SETTLE_S:
                time.sleep(0.1)
                continue
            if time.monotonic() >= deadline:
                _refuse(self.run_dir, info, info.get("what", "training"), relaunch=True, waited=wait_s)
            if not told:
                _tell_waiting(self.run_dir, info, info.get("what", "training"), wait_s)
                told = self.waited = True
            time.sleep(POLL_S)

    def remember(self) -> None:
        """On a rank that does not hold the lock: the lock file its holder (this job's rank 0) holds now, which
        :meth:`check_in_place` then compares with (the holder knows its own)."""
        if self._fd is not None:
            return
        with contextlib.suppress(OSError):
            self._identity = _identity(os.stat(self.path))

    def check_in_place(self) -> None:
        """End the run with one line when ``run_dir`` is no longer the directory this run locked: the lock file at
        its path gone or another file (its filesystem unmounted under the run, the directory moved or removed).
        One stat; called before each checkpoint and each metrics write, so nothing is written there then."""
        if self._identity is None:
            return
        try:
            now = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self._identity:
            fail(f"run_dir {self.run_dir} is no longer the directory this run locked: its lock file {LOCK} "
                 f"{'is gone' if now is None else 'there is another file'} (its filesystem unmounted, or the "
                 "directory moved or removed?); the run ends without writing there: mount or move it back, then "
                 "resume from its latest checkpoint")

    def mark_stopping(self, reason: str, grace_seconds: float) -> None:
        """Record that this holder is stopping (``reason``: the signal, or which launcher is gone), so a relaunch
        refused meanwhile names it and the time its save may still take. Never fails the stop itself, nor writes
        into a directory that is no longer the one locked."""
        if self._fd is None:
            return
        try:
            self.check_in_place()
        except UserError:
            return
        record = {**self.record, "reason": reason, "at": time.time(), "grace_seconds": grace_seconds}
        tmp = self.run_dir / f"{STOPPING}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.run_dir / STOPPING)  # whole or absent for a reader, on every node
        except OSError:
            pass

    @contextlib.contextmanager
    def undone_on_refusal(self):
        """A start refused inside (one line, a :class:`UserError`) leaves the run directory as :meth:`acquire` found
        it: what was written there since is removed, and the directory itself when acquire made it."""
        try:
            yield
        except UserError:
            if self._fd is not None:
                made = sorted(set(os.listdir(self.run_dir)) - (self.found or set()))
                self.release()
                for path in (self.run_dir / name for name in made):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
                if self.found is None:
                    self.run_dir.rmdir()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


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
