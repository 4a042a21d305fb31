"""What a config field may hold, declared beside it in its field metadata: a numeric range or a set of choices
(:class:`Valid`) and what a path must be (:class:`PathRule`). :mod:`llmjp_ds.validate` checks them all by one walk
of the tree; the types themselves are the loader's (:mod:`.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# the repository: DeepSpeed's JSON files (ds_configs/) are found there, and a run's own directory may not hold it
REPO_ROOT = Path(__file__).resolve().parents[2]

@dataclass(frozen=True)
class Valid:
    """The values a numeric field (or each number of a list field) may take; NaN and infinity never.

    The message reads ``<key> must be <rule> (<why>), got <value>``; ``says`` words the rule where bounds read
    worse ("positive"; ``{type}`` is the field's type), ``message`` (``str.format`` of ``where``, ``value`` and
    ``section``) replaces it where one check covers two fields. On a field holding a dataclass it is the rule of
    every field of that dataclass that declares none (``model.overrides``: the fields of a model shape)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False
    choices: tuple = ()
    why: str = ""
    says: str = ""
    message: str = ""

    def admits(self, value) -> bool:
        if self.choices:
            return value in self.choices
        return ((self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)) and
                (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)))

    def text(self) -> str:
        if self.says:
            return self.says
        if self.choices:
            return ", ".join(map(str, self.choices[:-1])) + f" or {self.choices[-1]}"
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi}"
        return "a finite number"


def at_least(lo, why: str = "", **kw) -> dict:
    return {"valid": Valid(lo=lo, why=why, **kw)}


def above(lo, why: str = "", **kw) -> dict:
    return {"valid": Valid(lo=lo, lo_open=True, why=why, **kw)}


def within(lo, hi, why: str = "", **kw) -> dict:
    return {"valid": Valid(lo=lo, hi=hi, why=why, **kw)}


def one_of(*choices, why: str = "") -> dict:
    return {"valid": Valid(choices=choices, why=why)}


@dataclass(frozen=True)
class PathRule:
    """A path field. ``input``: must exist (an input directory must hold ``inside``), else ``fix``; ``output``:
    it, or its nearest existing parent, must be a writable directory; ``own``: the run's own directory (not /, the
    home, the repository or the current directory, nor one that holds them)."""

    kind: str  # input | output
    fix: str = ""
    inside: str = ""
    own: bool = False


def input_path(fix: str, inside: str = "") -> dict:
    return {"path": PathRule("input", fix, inside)}


def output_path(own: bool = False) -> dict:
    return {"path": PathRule("output", own=own)}


# one check of both fields, worded as before the field rules
LR_MESSAGE = ("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got lr={section.lr}, "
              "min_lr_ratio={section.min_lr_ratio}")

DROPOUT_MESSAGE = ("{where} must be 0 (llmjp-ds's layers apply no dropout; LLM-jp trains without it, Megatron's "
                   "--attention-dropout 0.0 --hidden-dropout 0.0), got {value}: set it to 0")

PENALTY_MESSAGE = ("precision.guard.max_penalty must be > 0 and penalty_patience >= 1, got {section.max_penalty} "
                   "and {section.penalty_patience}")
SEED = within(0, 2**32 - 1, why="numpy seeds are 32-bit")

