"""Exit codes of every ``qatfactory`` command (one table, read by the CLI and by docs/reliability.md).

    0  OK           the command did what was asked; for ``verify``: PASS (every required check ran and agreed)
    1  FAIL         the parity gate found a difference between an export and its student (also at the
                    end of ``train ... export=...``: the export is then marked failed)
    2  INCOMPLETE   a required check could not run (a third-party tool is missing); the message says what
                    to install. Never counted as a pass.
    3  USAGE        a bad command line: unknown option, bad override, value out of range
    4  BAD_INPUT    a file or directory that cannot be used as given: missing, truncated, not ours to
                    replace, unsafe to load, a combination the engine cannot load; nothing was changed
    5  RUN_FAILED   training or evaluation stopped on an error inside the run (the message names it)
  130  INTERRUPTED  Ctrl-C
"""
import os
import sys
import traceback

OK = 0
FAIL = 1
INCOMPLETE = 2
USAGE = 3
BAD_INPUT = 4
RUN_FAILED = 5
INTERRUPTED = 130

TABLE = [
    (OK, "OK", "success; `verify`: PASS, every required check ran and agreed"),
    (FAIL, "FAIL", "the parity gate found a difference between the export and the student"),
    (INCOMPLETE, "INCOMPLETE", "a required check could not run (a third-party tool is missing); never a pass"),
    (USAGE, "USAGE", "bad command line: unknown option, bad override, value out of range"),
    (BAD_INPUT, "BAD_INPUT", "a file or directory that cannot be used as given (missing, truncated, not ours to "
                             "replace, unsafe to load, refused by the engine); nothing was changed"),
    (RUN_FAILED, "RUN_FAILED", "training or evaluation stopped on an error inside the run"),
    (INTERRUPTED, "INTERRUPTED", "interrupted (Ctrl-C)"),
]


# ----------------------------------------------------------------------------- errors
# An exception says which row of the table it belongs to with an ``exit_code`` attribute; the
# commands print one line (``one_line``) and return ``code_for(exc)``. QATFACTORY_DEBUG=1 prints
# the full traceback as well.
class QatfactoryError(Exception):
    exit_code = RUN_FAILED


class UsageError(QatfactoryError, ValueError):
    """A value on the command line / in the config that is not allowed (the message says what is)."""
    exit_code = USAGE


class BadInputError(QatfactoryError, ValueError):
    """A file or directory that cannot be used as given; nothing was changed."""
    exit_code = BAD_INPUT


class UnsafeFileError(BadInputError):
    """A file that would run code or follow somebody else's paths if loaded; refused."""


class CorruptFileError(BadInputError):
    """A truncated or garbled file (named in the message)."""


def code_for(exc: BaseException, default: int = RUN_FAILED) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    code = getattr(exc, "exit_code", None)
    return int(code) if isinstance(code, int) else default


def debug() -> bool:
    return os.environ.get("QATFACTORY_DEBUG", "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (the first line of a multi-line message, which for the
    libraries we call is the one that says what went wrong)."""
    msg = str(exc).strip() or type(exc).__name__
    first = msg.splitlines()[0].strip()
    more = " ..." if len(msg.splitlines()) > 1 else ""
    return f"{type(exc).__name__}: {first}{more}"


def report(prog: str, exc: BaseException, default: int = RUN_FAILED) -> int:
    """Print ``prog: NAME: Type: message`` on stderr (the traceback too under QATFACTORY_DEBUG=1)
    and return the exit code."""
    code = code_for(exc, default)
    name = {c: n for c, n, _ in TABLE}.get(code, str(code))
    if debug():
        traceback.print_exception(exc)
    hint = "" if debug() else " (QATFACTORY_DEBUG=1 shows the traceback)"
    print(f"{prog}: {name}: {one_line(exc)}{hint if code == RUN_FAILED else ''}", file=sys.stderr, flush=True)
    return code
