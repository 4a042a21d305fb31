"""The rendezvous of a multi-rank job, bounded in time, and the heartbeats that notice a host gone silent.

**Rendezvous.** Under the deepspeed launcher, srun, mpirun or by hand, rank 0 serves the job's TCP store on
MASTER_PORT and every other rank connects to it. ``torch.distributed.init_process_group`` would wait there for the
process group's whole timeout (DeepSpeed's: 10 minutes, per attempt) when a rank cannot reach the master, or never
started. :func:`open_store` opens the store here instead and :func:`join` makes every rank announce itself through
it, each with a deadline of ``parallel.rendezvous_timeout_s``:

* a rank that cannot reach the store ends with one line naming its host, the address it tried (as resolved on
  that host), and the fix;
* rank 0, when ranks have not joined by the deadline, names them and ends (their own hosts say why);
* every rank learns each rank's host name and address (the interface choice of the master's host needs another
  host's address; the heartbeat's messages name hosts).

The store is then handed to ``init_process_group``. Under torchrun the agents' own rendezvous already ran, and the
ranks join through a client of the agent's store.

**Heartbeats.** A host that goes silent (a dead node, a link down) leaves the others waiting in a collective until
``parallel.stall_timeout_s``, twenty minutes by default. When the ranks span several hosts, :class:`Heartbeat` runs
a thread in every rank that adds to its counter in the store every few seconds through a connection of its own,
apart from the collectives. The first rank of each host also reads every rank's counter. A counter that stays
still for ``parallel.heartbeat_timeout_s`` names its rank and host. A store that stops answering for that long
names the master's host. The rank that notices first prints one line and ends the job: the other ranks see the
``failed`` key, or the closed store, and end quietly. Every rank that ends the job for a silent host calls
``on_lost`` with that host's ranks and members (the ``lost`` key names it for the quiet ones), after its line is
out: it ends the launcher's ssh session to that host (:func:`llmjp_ds.launch.launcher.end_launch_sessions`),
which would otherwise keep the ``deepspeed`` command, or ``mpirun``, waiting. A rank whose process ended leaves a
refused connection, not silence: its peers' collectives fail at once, and the rank that failed says why; when it
died without a word (killed, its host's processes ended), :meth:`Heartbeat.report_lost_peer` names the host whose
address the failed collective's error carries, claimed in the store as the job's one line. :meth:`Heartbeat.stop`
marks a rank finished before the last barrier, so that a rank ending normally is never taken for a lost one. The
:class:`~llmjp_ds.parallel.context.ParallelContext` holds its rank's heartbeat.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from llmjp_ds.errors import fail
from llmjp_ds.launch.scheduler import route_interface

PREFIX = "llmjp_ds/"
LOST_EXIT = 3  # the exit status of a rank that ends the job for a lost peer (as the stall watchdog's)


@dataclass(frozen=True)
class Member:
    host: str  # the host's name
    addr: str  # its address on the route to the master (loopback on the master's host)


def _resolve(addr: str, port: int) -> str:
    try:
        return socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        fail(f"rank {os.environ.get('RANK', '?')} on {socket.gethostname()}: the master address {addr} does not "
             f"resolve there ({exc.strerror or exc}): make {addr} resolve on every host (/etc/hosts or DNS), or set "
             f"MASTER_ADDR to the first host's address")


def open_store(rank: int, world: int, addr: str, port: int, timeout_s: float, serve: bool = True):
    """Rank 0 (``serve``): serve the store on ``port``; the others, or every rank when torchrun's agent serves it:
    connect to ``addr:port`` within ``timeout_s``."""
    import torch.distributed as dist

    ip = _resolve(addr, port)
    if rank == 0 and serve:
        return dist.TCPStore(addr, port, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    try:
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError: refused, no route, timed out
        fail(f"rank {rank} on {socket.gethostname()} cannot reach the rendezvous at {addr}:{port} ({ip} there, "
             f"{_reason(exc)}) within parallel.rendezvous_timeout_s={timeout_s:g} s: check that {addr} resolves on "
             f"{socket.gethostname()} to the first host's address, that port {port} is open between the hosts, and "
             f"that rank 0 started (its host's output says why not); raise parallel.rendezvous_timeout_s if the "
             f"hosts start slowly")


def _reason(exc: BaseException) -> str:
    text = str(exc).lower()
    for key, said in (("refused", "connection refused"), ("no route", "no route to host"),
                      ("unreachable", "network unreachable"), ("timed out", "timed out"), ("timeout", "timed out")):
        if key in text:
            return said
    return str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def join(store, rank: int, world: int, addr: str, port: int, timeout_s: float, namespace: str = "") -> list[Member]:
    """Announce this rank and wait for all ``world`` ranks (``timeout_s``); every rank's host and address."""
    ns = f"{PREFIX}{namespace}"

    me = Member(socket.gethostname(), route_interface(addr, port)[0])  # open_store resolved addr already
    store.set(f"{ns}member/{rank}", f"{me.host}\t{me.addr}")
    store.set(f"{ns}beat/{rank}", "0")
    keys = [f"{ns}member/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, OSError):
        missing = [r for r, key in enumerate(keys) if not _check(store, key)]
        if rank == 0 and missing:
            fail(f"{_ranks_text(missing)} of {world} did not reach the rendezvous at {addr}:{port} within "
                 f"parallel.rendezvous_timeout_s={timeout_s:g} s: each says why in its host's output (or never "
                 f"started: see the launcher's lines for its host); raise parallel.rendezvous_timeout_s if the hosts "
                 f"start slowly")
        sys.exit(1)  # rank 0 names the missing ranks
    members = []
    for value in store.multi_get(keys):
        host, _, ip = value.decode().partition("\t")
        members.append(Member(host, ip))
    return members


def _check(store, key: str) -> bool:
    try:
        return store.check([key])
    except (RuntimeError, OSError):
        return False


def _get(store, key: str) -> str | None:
    """``key``'s value, None when it is not set (never waits for it)."""
    return store.get(key).decode() if _check(store, key) else None


def hosts(members: list[Member]) -> list[str]:
    """The distinct hosts of ``members``, in rank order."""
    return list(dict.fromkeys(m.host for m in members))


class Heartbeat:
    """This rank's beat, and (``checks``) the watch over every rank's; see the module docstring."""

    def __init__(self, addr: str, port: int, rank: int, members: list[Member], timeout_s: float, checks: bool,
                 namespace: str = "", on_lost=None):
        self.addr, self.port, self.rank, self.members = addr, port, rank, members
        self.timeout_s, self.checks = timeout_s, checks
        self.on_lost = on_lost  # called with {rank: Member} of a lost host before this rank ends the job for it
        self.ns = f"{PREFIX}{namespace}"
        self.master_host = members[0].host  # rank 0 serves the store (under torchrun its agent, on the same host)
        self.interval_s = max(0.2, min(5.0, timeout_s / 6))
        self.answered = time.monotonic()  # when the store last answered a round of beats
        self._stop = threading.Event()
        self._ending = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="llmjp-ds-heartbeat", daemon=True)
        self._watcher = threading.Thread(target=self._watch_store, name="llmjp-ds-heartbeat-watch", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        self._watcher.start()
        return self

    def _connect(self):
        import torch.distributed as dist

        return dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s),
                             wait_for_workers=False)

    def _run(self) -> None:
        try:
            store = self._connect()
        except (RuntimeError, OSError) as exc:
            self._store_lost(exc, time.monotonic())
            return
        keys = [f"{self.ns}beat/{r}" for r in range(len(self.members))]
        seen: dict[int, tuple[bytes, float]] = {}
        while not self._stop.is_set():
            try:
                store.add(keys[self.rank], 1)
                if store.check([f"{self.ns}failed"]):
                    self._end(None, _get(store, f"{self.ns}lost"))
                if self.checks:
                    now = time.monotonic()
                    for r, value in enumerate(store.multi_get(keys)):
                        if r == self.rank or value == b"done":
                            continue
                        last = seen.get(r)
                        if last is None or last[0] != value:
                            seen[r] = (value, now)
                        elif now - last[1] > self.timeout_s:
                            self._peer_lost(store, r, now - last[1])
                self.answered = time.monotonic()
            except (RuntimeError, OSError) as exc:
                if self._stop.is_set():
                    return
                self._store_lost(exc, self.answered)
            self._stop.wait(self.interval_s)

    def _ranks_on(self, host: str) -> dict[int, Member]:
        return {r: m for r, m in enumerate(self.members) if m.host == host}

    def _watch_store(self) -> None:
        """A store call that hangs past the timeout (a silent host: the socket waits on) counts as no answer."""
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self.answered > self.timeout_s + self.interval_s:
                self._store_lost(TimeoutError("timed out"), self.answered)

    def _peer_lost(self, store, rank: int, silent_s: float) -> None:
        m = self.members[rank]
        line = (f"error: [rank {self.rank}] rank {rank} on {m.host} ({m.addr}) has sent no heartbeat for "
                f"{silent_s:.0f} s: the host died, its network went down, or the process was stopped; ending the "
                f"job (relaunch without {m.host}: training resumes from the latest checkpoint)")
        self._end(line if self.claim(line, store, lost=m.host) else None, m.host)

    def _store_lost(self, exc: BaseException, since: float) -> None:
        if "refused" in str(exc).lower() or "reset" in str(exc).lower() or "broken pipe" in str(exc).lower():
            self._end(None)  # rank 0's process ended (its host answers): it, or its launcher, says why
            return
        line = (f"error: [rank {self.rank}] the rendezvous store on {self.master_host} ({self.addr}:{self.port}) has "
                f"not answered for {time.monotonic() - since:.0f} s ({_reason(exc)}): the host died or its network "
                f"went down; ending the job (relaunch without {self.master_host}: training resumes from the latest "
                f"checkpoint)")
        self._end(line if self.checks else None, self.master_host)

    def _end(self, line: str | None, lost: str | None = None) -> None:
        """End this process (status 3 with ``line``, else 1 quietly); ``on_lost`` for host ``lost`` runs after the
        line is out (it may end the launcher that carries this rank's output)."""
        if self._stop.is_set():
            return
        if not self._ending.acquire(blocking=False):
            threading.Event().wait()  # the other thread of this heartbeat is ending the process
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        if lost and self.on_lost is not None:
            try:
                self.on_lost(self._ranks_on(lost))
            except Exception:  # ending the job matters more
                pass
        os._exit(LOST_EXIT if line else 1)

    def report_lost_peer(self, exc: BaseException) -> bool:
        """A collective of this rank failed because a connection to a peer closed (``exc``): when the message names
        the address of another host of the job, print once for the job which host that is; True when it does."""
        lost: dict[tuple[str, str], list[int]] = {}
        for r, m in enumerate(self.members):
            if m.host != socket.gethostname() and re.search(rf"(?<![\d.]){re.escape(m.addr)}(?![\d])", str(exc)):
                lost.setdefault((m.host, m.addr), []).append(r)
        if not lost:
            return False
        (host, addr), ranks = next(iter(lost.items()))
        line = (f"error: [rank {self.rank}] the connection to {host} ({addr}, {_ranks_text(ranks)}) closed: its "
                f"processes ended or the host went down; ending the job (relaunch without {host}: training resumes "
                f"from the latest checkpoint)")
        if self.claim(line):
            print(line, file=sys.stderr, flush=True)
        return True

    def claim(self, line: str, store=None, lost: str | None = None) -> bool:
        """Whether ``line`` is the first failure reported in the store (the job prints one); ``lost``: the silent
        host it names, recorded first for the ranks that end quietly; ``store``: the heartbeat thread's connection
        (its errors are the thread's to handle), else a new one."""
        if store is not None:
            if lost:
                store.compare_set(f"{self.ns}lost", "", lost)
            return store.compare_set(f"{self.ns}failed", "", line).decode() == line
        try:
            return self.claim(line, self._connect(), lost)
        except (RuntimeError, OSError):
            return True  # the store is gone too: say it here

    def stop(self) -> None:
        """Mark this rank finished and end the thread (before the last barrier of a run that ends normally)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)
        try:
            self._connect().set(f"{self.ns}beat/{self.rank}", "done")
        except (RuntimeError, OSError):
            pass


def start_heartbeat(addr: str, port: int, rank: int, local_rank: int, members: list[Member], timeout_s: float,
                    namespace: str = "", on_lost=None) -> Heartbeat | None:
    """This rank's heartbeat, when the ranks span several hosts and ``timeout_s`` > 0 (None otherwise)."""
    if timeout_s <= 0 or len(hosts(members)) < 2:
        return None
    return Heartbeat(addr, port, rank, members, timeout_s, checks=local_rank == 0, namespace=namespace,
                     on_lost=on_lost).start()
