"""Which packages a venv holds at versions other than a lock's.

    python tools/lockdiff.py LOCK VENV_PYTHON

Prints one line per difference (changed, only in the venv, only in the lock)
and a count; always exits 0: drift is news for the developer, not a failure
(the suite run beside it says whether the newer releases still pass).
"""

from __future__ import annotations

import re
import subprocess
import sys


def pins(lines: list[str]) -> dict[str, str]:
    """``name==version`` lines as {normalised name: version} (PEP 503 names)."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return out


def main() -> None:
    lock_path, python = sys.argv[1], sys.argv[2]
    with open(lock_path) as f:
        locked = pins(f.readlines())
    frozen = subprocess.run(
        [python, "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    latest = pins(frozen)
    latest.pop("torch", None)  # the pinned CPU wheel, owned by the Makefile
    rows = []
    for name in sorted(locked.keys() | latest.keys()):
        a, b = locked.get(name), latest.get(name)
        if a != b:
            rows.append(f"  {name}: {a or '-'} -> {b or '-'}")
    print(f"{lock_path}: {len(rows)} package(s) differ from the newest the ranges allow")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
