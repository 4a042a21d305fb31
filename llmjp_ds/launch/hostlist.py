"""Slurm's compressed host and task lists, expanded: ``node[01-03,07],gpu-a[1-2]`` and ``2(x3),1``. Pure.

The rules are Slurm's (``src/common/hostlist.c``), so the result is what ``scontrol show hostnames`` prints, one
name a line, in order:

* a list is comma-separated at the top level; inside brackets, commas separate numbers and ``lo-hi`` ranges;
* a range is zero-padded to the width of its low end: ``[08-10]`` gives 08 09 10, ``[8-10]`` gives 8 9 10;
* several bracket groups in one name expand left to right, the first slowest: ``rack[1-2]-n[01-02]`` gives
  rack1-n01 rack1-n02 rack2-n01 rack2-n02;
* a repeated name is kept (as Slurm keeps it).

Anything else (an unclosed or nested bracket, a reversed range, a character no host name has) raises
:class:`HostlistError` with a short reason; the caller names the variable it came from.
"""

from __future__ import annotations

import itertools
import math
import re

MAX_HOSTS = 1_000_000  # a typo such as n[0-999999999] must not exhaust memory
_LITERAL = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


class HostlistError(ValueError):
    """A host or task list that cannot be expanded (the message says why, briefly)."""


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm hostlist, in Slurm's order."""
    text = text.strip()
    if not text:
        raise HostlistError("it is empty")
    hosts: list[str] = []
    for item in _split_top(text):
        if not item:
            raise HostlistError("it has an empty name between commas")
        hosts += _expand_item(item, MAX_HOSTS - len(hosts))
    return hosts


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (brackets checked: closed, not nested)."""
    items, start, inside = [], 0, False
    for i, ch in enumerate(text):
        if ch == "[":
            if inside:
                raise HostlistError(f"a '[' opens inside another at character {i + 1}")
            inside = True
        elif ch == "]":
            if not inside:
                raise HostlistError(f"a ']' at character {i + 1} closes nothing")
            inside = False
        elif ch == "," and not inside:
            items.append(text[start:i])
            start = i + 1
    if inside:
        raise HostlistError("a '[' is never closed")
    items.append(text[start:])
    return items


def _expand_item(item: str, room: int) -> list[str]:
    choices = []
    for part in re.split(r"(\[[^\]]*\])", item):
        if part.startswith("["):
            choices.append(_numbers(part[1:-1]))
        elif _LITERAL.fullmatch(part):
            choices.append([part])
        else:
            bad = next(ch for ch in part if not _LITERAL.fullmatch(ch))
            raise HostlistError(f"{item!r} holds {bad!r}, which no host name has")
    if math.prod(len(c) for c in choices) > room:
        raise HostlistError(f"{item!r} expands to more than {MAX_HOSTS} hosts")
    return ["".join(names) for names in itertools.product(*choices)]


def _numbers(body: str) -> list[str]:
    """The numbers of one bracket's body, e.g. ``01-03,07`` -> 01 02 03 07."""
    out: list[str] = []
    for spec in body.split(","):
        m = _RANGE.fullmatch(spec.strip())
        if not m:
            raise HostlistError(f"[{body}] holds {spec!r}, not a number or a lo-hi range")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"[{body}] holds the reversed range {spec}")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise HostlistError(f"[{body}] expands to more than {MAX_HOSTS} hosts")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node (``SLURM_TASKS_PER_NODE``), e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.strip().split(","):
        m = _TASKS.fullmatch(item.strip())
        if not m:
            raise HostlistError(f"{item!r} is not N or N(xM)")
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise HostlistError(f"it counts more than {MAX_HOSTS} nodes")
        counts += [int(m.group(1))] * repeat
    return counts
