"""The heartbeat's decisions in one process (the store served here, the peers simulated by their counters); the
same across real hosts is tests/parallel/test_hosts.py."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from llmjp_ds.parallel import rendezvous
from llmjp_ds.parallel.rendezvous import Heartbeat, Member
from tests.launch import free_port

MEMBERS = [Member("node1", "127.0.0.1"), Member("node2", "10.9.8.2"), Member("node2", "10.9.8.2")]


class Recorded(Heartbeat):
    """A heartbeat whose ending is recorded instead of ending the process."""

    ended: list

    def _end(self, line):
        if not self._stop.is_set():
            self.ended.append(line)
            self._stop.set()


def _store(port: int):
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    for r in range(len(MEMBERS)):
        store.set(f"{rendezvous.PREFIX}beat/{r}", "0")
    return store


def _watch(port: int, timeout_s: float = 0.6) -> Recorded:
    beat = Recorded("127.0.0.1", port, 0, MEMBERS, timeout_s, checks=True)
    beat.ended = []
    return beat.start()


def _wait(beat: Recorded, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not beat.ended and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_rank_whose_counter_stays_still_is_named_once_with_its_host():
    port = free_port()
    store = _store(port)
    store.set(f"{rendezvous.PREFIX}beat/2", "done")  # rank 2 finished: never counted as lost
    beat = _watch(port)
    _wait(beat, 5)
    assert beat.ended and "rank 1 on node2 (10.9.8.2) has sent no heartbeat for" in beat.ended[0]
    assert store.get(f"{rendezvous.PREFIX}failed").decode() == beat.ended[0]  # claimed for the job


def test_ranks_that_beat_are_not_lost_and_a_claimed_failure_ends_the_others_quietly():
    port = free_port()
    store = _store(port)
    beat = _watch(port)
    for _ in range(30):  # 1.5 s of beats from ranks 1 and 2, longer than the 0.6 s timeout
        store.add(f"{rendezvous.PREFIX}beat/1", 1)
        store.add(f"{rendezvous.PREFIX}beat/2", 1)
        time.sleep(0.05)
    assert beat.ended == []
    store.set(f"{rendezvous.PREFIX}failed", "error: [rank 1] something else")
    _wait(beat, 5)
    assert beat.ended == [None]  # another rank said it: this one ends without a line


@pytest.mark.parametrize("text, named", [
    ("Connection closed by peer [10.9.8.2]:4567", True),
    ("Connection reset by peer 10.9.8.2", True),
    ("Connection closed by peer [10.9.8.23]:4567", False),
    ("Connection closed by peer [110.9.8.2]:4567", False),
])
def test_a_closed_connection_names_the_host_whose_address_it_carries(text, named, capsys, monkeypatch):
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(Heartbeat, "claim", lambda self, line, store=None: True)
    beat = Heartbeat("127.0.0.1", free_port(), 0, MEMBERS, 1.0, checks=True)  # never started
    assert beat.report_lost_peer(RuntimeError(text)) is named
    err = capsys.readouterr().err
    assert ("the connection to node2 (10.9.8.2, ranks 1, 2) closed" in err) is named
