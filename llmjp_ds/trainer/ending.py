"""How a run ends early with one line: a health verdict whose action is stop, one rollback more than the limit,
non-finite steps in a row, a record that can no longer be written. Each leaves a ``stop`` event in the record
first (where the record can still be written), so ``llmjp-ds health`` shows that the run stopped and why, and a
resume keeps it."""

from __future__ import annotations

from typing import NoReturn

from llmjp_ds.errors import UserError, fail
from llmjp_ds.health.monitor import Verdict
from llmjp_ds.launch.failure import PeerFailure


def stop(logger, step: int, line: str, latest: str | None) -> NoReturn:
    """End the run with ``line``, after a ``stop`` event at ``step`` that records it and the latest checkpoint."""
    logger.event(step, "stop", reason=line, latest=latest)
    fail(line)


def verdict_line(verdict: Verdict, latest: str | None) -> str:
    """The line of a verdict whose configured action is stop."""
    key = f"health.{verdict.kind}{'.action' if verdict.kind != 'nonfinite' else ''}"
    return (f"{verdict.describe()}; {key} is stop: the run ends here, and {latest or 'no checkpoint'} is its latest "
            "checkpoint; look at the data around it, or choose another action")


def rollback_limit_line(verdict: Verdict, health) -> str:
    """The line of a spike that would be one rollback more than ``health.max_rollbacks`` allows."""
    return (f"{verdict.describe()}, one rollback more than health.max_rollbacks={health.max_rollbacks} within "
            f"health.rollback_window={health.rollback_window} steps: the run stops rather than loop; look at the "
            "data or lower optim.lr, then resume (or raise health.max_rollbacks)")


def nonfinite_line(in_a_row: int, step: int) -> str:
    return (f"{in_a_row} consecutive steps had non-finite loss or gradients (last: step {step}); a checkpoint was "
            "saved. Lower optim.lr or check the data, then resume")


def end_on_lost_record(failure: str | None, save, rank: int) -> NoReturn:
    """The record cannot be written any more (``failure``, on rank 0: a full disk): every rank saves a checkpoint
    if one fits (``save()`` returns its tag), then the run ends: rank 0 with one line that says both, a rank whose
    save failed with its own, the others quietly (exit 1)."""
    try:
        tag = save()
    except UserError as exc:
        fail(f"{failure or 'the run record could not be written on rank 0'}, and the checkpoint after it could "
             f"not be saved either: {exc}")
    if rank != 0:
        raise PeerFailure("rank 0 cannot write the run's record")
    fail(f"{failure}: checkpoint {tag} holds the run up to here; free space, then resume (the record keeps every "
         "line written before)")
