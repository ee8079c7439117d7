#!/usr/bin/env python3
"""Write constraints.txt from the virtual environment `make test` just passed in (`make lock`).

    python scripts/lock.py .venv/bin/pip constraints.txt

Every installed distribution is pinned to its version, for the Python it was tested on only (an environment
marker), except torch (the Makefile pins it) and this package itself. The file is written atomically.
"""
import datetime
import os
import platform
import subprocess
import sys
import tempfile

SKIP = {"torch", "qatfactory"}


def pins(pip: str) -> list[str]:
    out = subprocess.run([pip, "freeze", "--exclude-editable"], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        name, sep, _ = line.partition("==")
        if not sep:   # a direct URL or a path: not something a constraints file can pin by version
            raise SystemExit(f"lock: cannot pin {line!r} (not installed from an index); install it from PyPI first")
        if name.lower().replace("_", "-") not in SKIP:
            rows.append(line)
    return sorted(rows, key=str.lower)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    pip, path = argv
    py = ".".join(platform.python_version_tuple()[:2])
    today = datetime.date.today().isoformat()
    head = [
        f"# The exact versions `make test` last passed with ({today}, Python {py}; torch is the Makefile's TORCH).",
        "# `make install` installs with these as pip constraints, so CI and a fresh machine test what was tested:",
        "# an unpinned transformers 5.25 once pulled in a package that broke 432 tests. The package itself",
        "# (setup.py) keeps its ranges. To move on: edit a pin (or delete this file), make test, then `make lock`.",
        f"# The pins hold on Python {py}, the version they were tested on; another Python resolves setup.py's ranges.",
    ]
    body = [f'{row} ; python_version == "{py}"' for row in pins(pip)]
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".constraints-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(head + body) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"lock: {len(body)} pins for Python {py} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
