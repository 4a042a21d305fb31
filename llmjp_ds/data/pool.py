"""An ordered process pool: ``worker(task)`` for a stream of tasks in N processes, results in input order.

The worker is an object handed to each process once, at its start; whatever it caches (a loaded tokenizer, an
open parquet file) lives on that object in that process, so nothing is kept in module globals. At most
``window`` tasks are in flight, so memory stays flat however long the stream. A worker's exception comes back
with its task's result and is raised in the caller; a worker that dies (killed, out of memory) ends the run
with one line. Closing the generator early (an error in the input) terminates the workers.
"""

from __future__ import annotations

import multiprocessing
import queue
from typing import Callable, Iterable, Iterator

from llmjp_ds.errors import fail

_POLL_SECONDS = 1.0


def _serve(worker: Callable, tasks, results) -> None:
    """A worker process: run tasks until the ``None`` sentinel."""
    while True:
        item = tasks.get()
        if item is None:
            return
        seq, task = item
        try:
            results.put((seq, worker(task), None))
        except BaseException as exc:  # handed to the caller, which raises it
            results.put((seq, None, exc))


def _context():
    # fork: workers need only what the parent already imported, and spawn cannot start from a REPL or a stdin
    # script; spawn where fork does not exist
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def ordered_map(worker: Callable, tasks: Iterable, workers: int, window: int | None = None) -> Iterator:
    """``worker(task)`` for every task, in order; in this process for one worker, else in ``workers`` processes."""
    if workers <= 1:
        for task in tasks:
            yield worker(task)
        return
    window = window or 2 * workers + 2
    ctx = _context()
    todo, done = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(worker, todo, done), daemon=True) for _ in range(workers)]
    finished = False
    try:
        for p in procs:
            try:
                p.start()
            except OSError as exc:
                fail(f"cannot start {workers} worker processes ({exc.strerror or exc}): lower --workers")
        ready: dict[int, object] = {}
        submitted = taken = 0
        for task in tasks:
            todo.put((submitted, task))
            submitted += 1
            while submitted - taken >= window:
                yield _next_result(done, ready, taken, procs)
                taken += 1
        while taken < submitted:
            yield _next_result(done, ready, taken, procs)
            taken += 1
        for _ in procs:
            todo.put(None)
        for p in procs:
            p.join()
        finished = True
    finally:
        if not finished:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                if p.pid is not None:
                    p.join()
        for q in (todo, done):  # never wait at exit for data no one will read
            q.cancel_join_thread()
            q.close()


def _next_result(done, ready: dict, seq: int, procs):
    """The result of task ``seq``, waiting for it; raises the worker's exception, or fails if a worker died."""
    while seq not in ready:
        try:
            got, result, exc = done.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                code = dead[0].exitcode
                why = "killed, perhaps for memory" if code < 0 else f"exit code {code}"
                fail(f"a worker process died ({why}): lower --workers, or check the machine's memory")
            continue
        ready[got] = (result, exc)
    result, exc = ready.pop(seq)
    if exc is not None:
        raise exc
    return result
