"""Stopping early: a stop signal, or this rank's launcher gone, ends the run at the next step boundary with a
checkpoint and exit 0, once every rank has agreed at the end of a step (:func:`any_rank_stopping`)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

from llmjp_ds.launch import launcher


class StopRequest:
    """A stop signal (``checkpoint.stop_signals``, by default SIGTERM and SIGINT), or this rank's launcher gone
    (:mod:`llmjp_ds.launch.launcher`: the DeepSpeed runner or launch, torchrun's agent): finish the current
    step, save, exit 0. The first request counts; later signals (a scheduler signals the whole process group,
    then DeepSpeed's launch forwards SIGTERM again) change nothing. A timer ends the process if the save takes
    longer than the grace time (the checkpoint being written is then simply not named by ``latest``).
    ``on_request(reason)`` runs once, at the request (rank 0 records in the run directory that it is stopping)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the default of checkpoint.stop_signals

    def __init__(self, grace_seconds: float, rank: int = 0, launchers: list = (), signals=SIGNALS,
                 on_request=None):
        self.requested = False
        self.reason: str | None = None
        self.grace = grace_seconds
        self.rank = rank
        self.signals = tuple(signals)
        self._on_request = on_request
        self._lock = threading.RLock()  # the signal handler (main thread) and the launcher watcher (its thread)
        for sig in self.signals:
            signal.signal(sig, self._handler)
        atexit.register(self._ignore_signals_at_exit)
        self.launcher_watch = launcher.watch(list(launchers), self._launcher_gone)

    def _handler(self, signum, frame):
        self.request(signal.Signals(signum).name)

    def _launcher_gone(self, gone) -> None:
        self.request(f"{gone.describe()} is gone")
        try:
            print(f"[llmjp-ds] [rank {self.rank}] {gone.describe()} is gone: stopping as on SIGTERM (a checkpoint at "
                  "the end of this step, then exit)", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # the launcher took our terminal or pipe with it
            pass

    def request(self, reason: str) -> None:
        """Stop at the next step boundary (``reason``: the signal's name, or which launcher is gone)."""
        with self._lock:
            if self.requested:
                return
            self.requested, self.reason = True, reason
        timer = threading.Timer(self.grace, lambda: os._exit(143))
        timer.daemon = True
        timer.start()
        if self._on_request is not None:
            self._on_request(reason)

    def _ignore_signals_at_exit(self) -> None:
        """At interpreter exit (the run saved and ended): ignore the stop signals. CPython's finalization,
        right after the atexit hooks, puts SIG_DFL back for every signal a Python handler holds (it leaves
        SIG_IGN alone), then tears the modules down, ~1 s with torch and DeepSpeed loaded: a second Ctrl-C or a
        launcher's forwarded SIGTERM in that second would end the process by the signal after its save."""
        for sig in self.signals:
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, signal.SIG_IGN)


def any_rank_stopping(stop: StopRequest, ctx, record_lost: bool = False) -> tuple[bool, bool]:
    """Whether any rank was asked to stop, and whether any rank lost its record (``record_lost``: rank 0's
    metrics could not be written): one all-reduce at the end of every step, so that every rank saves the same step
    and ends. A stop request on another rank becomes this rank's too."""
    stopping, lost = ctx.any_rank_of(stop.requested, record_lost)
    if stopping and not stop.requested:  # another rank's signal: this one's grace timer and record too
        stop.request("a stop request on another rank")
    return stopping, lost
