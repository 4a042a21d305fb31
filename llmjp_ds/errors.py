"""User-facing errors: one line that names the problem and the fix, no traceback.

Every check on user input raises :class:`UserError`. The CLI prints ``error: <message>`` and exits non-zero;
``--debug`` (or ``LLMJP_DS_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Callable, Iterable, NoReturn


class UserError(Exception):
    """A problem with the user's input (config, data, paths, hardware) that the user can fix."""

    exit_code = 2


def fail(message: str) -> NoReturn:
    raise UserError(message)


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the option closest to a mistyped ``name``, or an empty string."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def debug_enabled(argv: list[str] | None = None) -> bool:
    argv = sys.argv if argv is None else argv
    return "--debug" in argv or os.environ.get("LLMJP_DS_DEBUG", "") not in ("", "0")


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> NoReturn:
    """Run ``main(argv)``; turn a :class:`UserError` into one line on stderr and its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        code = main(argv)
    except UserError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(int(code or 0))
