"""The heartbeat's decisions in one process (the store served here, the peers simulated by their counters); the
same across real hosts is tests/parallel/test_hosts.py."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from llmjp_ds.launch import rendezvous
from llmjp_ds.launch.rendezvous import Heartbeat, Member
from tests.launch import free_port

MEMBERS = [Member("node1", "127.0.0.1"), Member("node2", "10.9.8.2"), Member("node2", "10.9.8.2")]


class Recorded(Heartbeat):
    """A heartbeat whose ending is recorded instead of ending the process: its line, and the ranks it would hand
    to ``on_lost`` (those of the silent host)."""

    ended: list
    lost: list

    def _end(self, line, lost=None):
        if not self._stop.is_set():
            self.ended.append(line)
            self.lost.append(sorted(self._ranks_on(lost)) if lost else None)
            self._stop.set()


def _store(port: int):
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    for r in range(len(MEMBERS)):
        store.set(f"{rendezvous.PREFIX}beat/{r}", "0")
    return store


def _watch(port: int, timeout_s: float = 0.6) -> Recorded:
    beat = Recorded("127.0.0.1", port, 0, MEMBERS, timeout_s, checks=True)
    beat.ended, beat.lost = [], []
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
    assert store.get(f"{rendezvous.PREFIX}lost").decode() == "node2" and beat.lost == [[1, 2]]  # node2's ranks


def test_ranks_that_beat_are_not_lost_and_a_claimed_failure_ends_the_others_quietly():
    port = free_port()
    store = _store(port)
    beat = _watch(port)
    for _ in range(30):  # 1.5 s of beats from ranks 1 and 2, longer than the 0.6 s timeout
        store.add(f"{rendezvous.PREFIX}beat/1", 1)
        store.add(f"{rendezvous.PREFIX}beat/2", 1)
        time.sleep(0.05)
    assert beat.ended == []
    store.set(f"{rendezvous.PREFIX}lost", "node2")
    store.set(f"{rendezvous.PREFIX}failed", "error: [rank 1] something else")
    _wait(beat, 5)
    assert beat.ended == [None]  # another rank said it: this one ends without a line
    assert beat.lost == [[1, 2]]  # ... but ends the launcher's sessions to the host that rank named


@pytest.mark.parametrize("text, named", [
    ("Connection closed by peer [10.9.8.2]:4567", True),
    ("Connection reset by peer 10.9.8.2", True),
    ("Connection closed by peer [10.9.8.23]:4567", False),
    ("Connection closed by peer [110.9.8.2]:4567", False),
])
def test_a_closed_connection_names_the_host_whose_address_it_carries(text, named, capsys, monkeypatch):
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(Heartbeat, "claim", lambda self, line, store=None, lost=None: True)
    beat = Heartbeat("127.0.0.1", free_port(), 0, MEMBERS, 1.0, checks=True)  # never started
    assert beat.report_lost_peer(RuntimeError(text)) is named
    err = capsys.readouterr().err
    assert ("the connection to node2 (10.9.8.2, ranks 1, 2) closed" in err) is named


def test_the_deepspeed_launchers_ssh_session_to_the_lost_node_is_ended_and_no_other():
    """pdsh holds one ssh session per host, its remote command the job's ``launch`` with that host's --node_rank:
    the lost ranks' node's session of this job ends; another node's, or another job's, stays."""
    import base64
    import json
    import subprocess
    import sys

    from llmjp_ds.launch import launcher

    world = {"node1": [0, 1], "node2": [0, 1], "node3": [0, 1]}
    info = base64.urlsafe_b64encode(json.dumps(world).encode()).decode()
    other = base64.urlsafe_b64encode(json.dumps({**world, "node4": [0]}).encode()).decode()
    assert launcher.launch_world(["python", f"--world_info={info}", "--master_port=29500"]) == (info, "29500",
                                                                                                [2, 2, 2])
    assert launcher.nodes_of([2, 3], [2, 2, 2]) == [1] and launcher.nodes_of([0, 5], [2, 2, 2]) == [0, 2]

    def process(*argv: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])

    def session(node: int, job: str = info, port: int = 29500) -> subprocess.Popen:  # as pdsh's ssh child
        return process("-2", "-a", "-x", f"node{node + 1}", f"export A=1; cd /r; python -u -m deepspeed.launcher."
                       f"launch --world_info={job} --node_rank={node} --master_addr=10.9.8.1 --master_port={port} t.py")

    launch = process(f"--world_info={info}", "--node_rank=0", "--master_addr=10.9.8.1", "--master_port=29500")
    lost, alive, another_job, another_port = session(1), session(2), session(1, other), session(1, port=29501)
    procs = [launch, lost, alive, another_job, another_port]
    try:
        time.sleep(0.5)  # their command lines are in place
        ranks_launch = [launcher.Launcher(launch.pid, launcher._stat(launch.pid)[2], "deepspeed launch")]
        node2 = {2: Member("node2", "10.9.8.2"), 3: Member("node2", "10.9.8.2")}
        assert launcher.end_launch_sessions(ranks_launch, node2) == [lost.pid]
        assert lost.wait(10) == -15 and all(p.poll() is None for p in procs if p is not lost)
        assert launcher.end_launch_sessions([], node2) == []  # not under the deepspeed launcher: nothing
    finally:
        for p in procs:
            p.kill()
            p.wait()


MPIRUN = """
import os, signal, subprocess, sys, time
python = sys.argv[1]  # sys.executable names this process's mpirun
interrupts = []
signal.signal(signal.SIGINT, lambda *_: interrupts.append(1))
sleeper = [python, "-c", "import time; time.sleep(60)"]
lost = subprocess.Popen([*sleeper, "-x", "node2", "orted -mca ess env"])  # as mpirun's ssh to each daemon's host
kept = subprocess.Popen([*sleeper, "-x", "node3", "orted -mca ess env"])
time.sleep(0.5)
rank = subprocess.run([python, "-c", "from llmjp_ds.launch import launcher, rendezvous; print(launcher."
                       "end_launch_sessions([], {1: rendezvous.Member('node2', '10.9.8.2')}))"],
                      capture_output=True, text=True)
print(rank.stdout.strip() == str([os.getpid(), lost.pid]), lost.wait(10), kept.poll(), len(interrupts), rank.stderr)
kept.kill()
"""


def test_under_mpirun_the_session_to_the_lost_host_ends_and_mpirun_is_interrupted_twice():
    """A rank whose parent is mpirun (its command line's first word): mpirun gets two SIGINTs (the second ends it
    without waiting for the silent host's daemon), and its ssh session to that host's daemon ends; another host's
    stays."""
    import subprocess
    import sys

    from tests.launch import REPO, subprocess_env

    as_mpirun = 'exec -a "${0%/*}/mpirun" "$0" -c "$1" "$0"'  # argv[0] .../mpirun, beside the venv's python
    done = subprocess.run(["bash", "-c", as_mpirun, sys.executable, MPIRUN], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split()[:4] == ["True", "-15", "None", "2"], done.stdout + done.stderr
