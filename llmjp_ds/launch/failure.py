"""How a multi-rank job ends when something goes wrong on one rank: every rank ends, in seconds, and the cause
is printed once.

* :func:`end_on_error`: an exception on a rank after the process groups exist. The rank that failed prints
  one line tagged with its rank (``error: [rank 3] ...``) and exits at once, without a barrier or any other
  collective: the ranks waiting for it in a collective then fail too (gloo reports the closed connection at
  once; the launcher, torchrun or DeepSpeed's, ends the rest when a worker exits non-zero), and exit quietly.
* :class:`Watchdog`: a rank that stops answering (a hung GPU, a dead node, SIGSTOP) leaves the others waiting
  in a collective. Each rank's watchdog thread ends its rank when no step phase has finished for
  ``parallel.stall_timeout_s``, with a message naming the step and the phase it was in.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from llmjp_ds.errors import UserError, debug_enabled

class PeerFailure(Exception):
    """This rank is fine, but a collective check found another rank failing (which reports it)."""


# what a collective raises on a rank whose peer has died: that rank is not the cause, and stays quiet
PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe", "nccl error",
                     "nccl communicator was aborted", "process group", "socket", "timed out")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank died (not this rank's own problem)."""
    import torch.distributed as dist

    if isinstance(exc, (PeerFailure, getattr(dist, "DistBackendError", ()), getattr(dist, "DistNetworkError", ()))):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in PEER_FAILURE_TEXT)


def _distributed() -> bool:
    if "torch.distributed" not in sys.modules:  # failed before torch loaded (a config error)
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def end_on_error(exc: BaseException) -> None:
    """End this rank of a multi-rank job after ``exc``: one tagged line (only on the rank that caused it) and an
    immediate exit, no collective. Returns (to let the caller re-raise) when no multi-rank job is running."""
    if not _distributed():
        return
    import torch.distributed as dist

    rank = dist.get_rank()
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 1
    elif isinstance(exc, KeyboardInterrupt):
        code = 130
    elif isinstance(exc, UserError):
        print(f"error: [rank {rank}] {exc}", file=sys.stderr)
        code = exc.exit_code
    elif is_peer_failure(exc):
        code = 1  # another rank failed first and said why (or, a host gone: ParallelContext.report_failure did)
    else:
        traceback.print_exception(exc)
        print(f"error: [rank {rank}] {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        code = 1
    if debug_enabled() and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        traceback.print_exception(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# code that runs between the phase beats (after the optimizer: the loss all-reduce, logging, the stop request's
# all-reduce, a save; barriers), and how the watchdog names it when the rank is found there: (qualified name of
# the function, of its caller or None for any) -> phase. Read from the main thread's stack when the watchdog
# fires, so a stall outside the beaten phases is not reported as the last phase beaten.
SECTIONS = {
    ("ParallelContext.any_rank_of", "any_rank_stopping"): "stop check",
    ("ParallelContext.all_reduce", "EngineRunner.train_step"): "loss all-reduce",
    ("ParallelContext.all_reduce", "PipelineRunner.train_step"): "loss all-reduce",
    ("ParallelContext.all_reduce", "EngineRunner.eval_loss"): "evaluation",
    ("ParallelContext.all_reduce", "PipelineRunner.eval_loss"): "evaluation",
    ("Checkpointer.save", None): "checkpoint",
    ("Resume.rollback", None): "checkpoint",
    ("Evaluator.evaluate", None): "evaluation",
    ("PrecisionController.choose_recipe", None): "evaluation",
    ("MetricsLogger.log", None): "logging",
    ("ParallelContext.any_rank_of", None): "an any-rank check",
    ("ParallelContext.barrier", None): "a barrier",
}
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section_of(frame) -> str | None:
    """What ``frame``'s stack (innermost first) says the thread is doing, from :data:`SECTIONS`."""
    names = []
    while frame is not None:
        code = frame.f_code
        if os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR) and code.co_filename != __file__:
            names.append(getattr(code, "co_qualname", code.co_name))
        frame = frame.f_back
    for i, name in enumerate(names):
        caller = names[i + 1] if i + 1 < len(names) else None
        for key in ((name, caller), (name, None)):
            if key in SECTIONS:
                return SECTIONS[key]
    return None


class Watchdog:
    """Ends this rank when the step it marks makes no progress for ``timeout_s`` seconds.

    The trainer and the step runners call :meth:`beat` at every phase boundary (data, forward, backward,
    optimizer, evaluation, checkpoint) with the step they work on, numbered from 1 as the log numbers it;
    :meth:`arm` starts the clock (setup is not watched: loading a checkpoint of a large model takes longer than a
    step). Its message names that step, and the phase from the main thread's stack where that is more precise than
    the last beat (:data:`SECTIONS`): a rank stalled in the stop request's all-reduce after ``step N`` was logged
    is "in step N (stop check)", not in step N's optimizer."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self.step: int | None = None  # the step (numbered from 1) of the last beat that named one
        self.phase = "setup"
        self.last = time.monotonic()
        self.armed = False
        self._main = threading.main_thread()
        self._thread = threading.Thread(target=self._watch, name="llmjp-ds-watchdog", daemon=True)

    def arm(self) -> None:
        self.last = time.monotonic()
        self.armed = True
        if not self._thread.is_alive():
            self._thread.start()

    def beat(self, phase: str, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step
        self.last = time.monotonic()

    def stalled_for(self) -> float:
        return time.monotonic() - self.last if self.armed else 0.0

    def where(self) -> str:
        """'step N (phase)' in the log's numbering: what the main thread is doing now."""
        phase = self.phase
        try:
            frame = sys._current_frames().get(self._main.ident)
            phase = _section_of(frame) or phase
        except Exception:  # the stack is only a refinement
            pass
        return f"{'before step 1' if self.step is None else f'in step {self.step}'} ({phase})"

    def _watch(self) -> None:
        interval = max(0.2, min(5.0, self.timeout_s / 10))
        while True:
            time.sleep(interval)
            stalled = self.stalled_for()
            if stalled > self.timeout_s:
                print(f"error: [rank {self.rank}] no progress for {stalled:.0f} s {self.where()}: a rank stopped "
                      f"answering (hung GPU, dead node, SIGSTOP), or this phase takes longer than "
                      f"parallel.stall_timeout_s={self.timeout_s:g}; ending the job",
                      file=sys.stderr, flush=True)
                os._exit(3)
