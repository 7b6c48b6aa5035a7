# The two commands of the README: `make demo` (the main job) and `make test` (what CI runs).
# Both bootstrap a fresh machine first (scripts/bootstrap.sh).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
LINTED := clients cache_service sglang_r3 tests bench

.PHONY: bootstrap test lint typecheck pytest demo rl-demo bench

bootstrap:
	./scripts/bootstrap.sh

lint: bootstrap
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

typecheck: bootstrap
	$(VENV)/bin/mypy

# pytest exits 5 when it collects nothing; make treats every non-zero exit as failure.
# Two workers, each file on one of them (its module-scoped servers started once): the
# suite waits on servers about half the time, so on 2 cores 27 min instead of about 45
# (issue 53's CI ran out of its 90 minutes serially). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
pytest: bootstrap
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

test: lint typecheck pytest

demo: bootstrap
	$(VENV)/bin/r3 demo

# A GRPO loop with weight pushes to SGLang, replay on vs off (docs/rl-demo.md).
rl-demo: bootstrap
	$(VENV)/bin/r3 rl-demo --out rl-demo-out

bench: bootstrap
	$(PY) bench/codec_bench.py
	$(PY) bench/service_bench.py
	$(PY) bench/client_bench.py
	$(PY) bench/deploy_sizing.py
