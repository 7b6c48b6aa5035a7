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
pytest: bootstrap
	$(PY) -m pytest

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
