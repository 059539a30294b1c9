# fabriclite: `make demo` runs the example, `make test` runs the tests. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fabriclite-installed
# CPU build of torch; a looser pin would download a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test test-core bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

demo: venv
	$(PY) examples/demo.py
	$(PY) examples/train.py

include mk/backends.mk

test-core: venv
	$(PY) -m pytest -q tests

test: test-core test-backends

bench: venv
	$(PY) -m pip install -q -e ".[bench]" "$(TORCH_PIN)"
	$(PY) benchmarks/launch.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
