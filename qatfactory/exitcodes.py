"""Exit codes of every ``qatfactory`` command (one table, read by the CLI and by the README).

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
