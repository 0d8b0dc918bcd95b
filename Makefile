# Two entry points for a fresh clone: `make demo` and `make test`.
# torch is installed first, pinned, so that resolving the package never pulls
# a CUDA build of several GB.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean venv test-triton

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev,transfer,redis]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvarena demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest -q

# Type-check the package (not part of `make test`, which must stay fast on 2 cores).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy src/kvarena --ignore-missing-imports

bench: $(STAMP)
	$(PY) benchmarks/bench_entry_copy.py
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_boundary.py
	$(PY) benchmarks/bench_transfer.py
	$(PY) benchmarks/bench_prefix.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis

# The Triton kernel under Triton's CPU interpreter (downloads Triton, ~0.5 GB;
# not part of `make test`). On a CUDA machine tests/test_gpu.py runs it for real.
test-triton: $(STAMP)
	$(PY) -m pip install --quiet triton
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_copy.py
