# Two commands do everything on a fresh machine: `make shards` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CXX    ?= g++
TEST_JOBS ?= 2
# The extras `make install` adds: `cpu` is the CPU MXNet wheel. On a CUDA machine put its MXNet wheel into .venv
# first and leave `cpu` out (`make install EXTRAS=dev`): pip never replaces an MXNet already there then.
EXTRAS ?= cpu,dev

.PHONY: install shards test lint train bench clean

install: $(VENV)/.installed build/seqgen
	@# An editable install is not byte-compiled (pip compiles only what it copies), and with
	@# PYTHONDONTWRITEBYTECODE=1 every process would compile our modules again (~0.1 s a start).
	@$(PY) -m compileall -q -j 0 shardgen loader benchmarks

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

build/seqgen: shardgen/reference/seqgen.cpp
	mkdir -p build
	$(CXX) -O2 -std=c++17 -Wall -o $@.tmp $< && mv $@.tmp $@

shards: install
	$(VENV)/bin/shardgen build -c shardgen.toml

test: install
	@# Two test processes (pytest-xdist): much of the suite waits on subprocesses, signals and TTLs, and every
	@# bound in it holds beside two CPU hogs. TEST_JOBS=0 runs it in one process.
	$(PY) -m pytest -q -ra -n $(TEST_JOBS)

train: install
	$(PY) -m loader.tools.train --manifest shards/manifest.json --epochs 2 --val-from 2024-01-29

bench: install
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks

lint: install
	$(VENV)/bin/ruff check shardgen loader tests benchmarks

clean:
	rm -rf build raw shards .pytest_cache
