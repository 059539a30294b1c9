# fabriclite: `make demo` runs the example, `make test` runs the tests. Both bootstrap .venv on first use.
# `make bench` runs every benchmark (tables in benchmarks/results/, plots in docs/); `make test-stress` runs the core
# suite 3 times under CPU load; `make gpu-check PYTHON=python3` runs the CUDA/NCCL checks with that interpreter as it
# is (no .venv; skips with one line where there is no GPU).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fabriclite-installed
# CPU build of torch; a looser pin would download a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# setuptools' note on every editable install of this flat layout ("Editable installation. Please be careful with
# folders in your working directory with the same name as your package"), which pip >= 25.3 shows as a warning even
# with -q: informational only, so not shown. Every other warning of the build is.
NO_EDITABLE_NOTE := -W "ignore:Editable installation"

.PHONY: venv demo test test-core test-stress bench gpu-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) $(NO_EDITABLE_NOTE) -m pip install -q -e ".[test]"
	@touch $(STAMP)

demo: venv
	$(PY) examples/demo.py
	$(PY) examples/train.py

include mk/backends.mk
include mk/engines.mk

test-core: venv
	$(PY) -m pytest -q tests

test: test-core test-backends test-engines

# the core suite 3 times in a row, 2 busy processes loading the CPUs, no retries (STRESS_TESTS: a subset)
STRESS_TESTS ?= tests
test-stress: venv
	bash scripts/test_stress.sh $(PY) $(STRESS_TESTS)

gpu-check:
	@bash scripts/gpu_check.sh $(PYTHON)

# every benchmark, each writing benchmarks/results/<name>.md; the plots into docs/
bench: venv
	$(PY) $(NO_EDITABLE_NOTE) -m pip install -q -e ".[bench]" "$(TORCH_PIN)"
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/collectives.py --plot docs/collectives_benchmark.png
	$(PY) benchmarks/fsdp.py --plot docs/fsdp_benchmark.png
	$(PY) benchmarks/training.py
	$(PY) benchmarks/collective_watch.py
	$(PY) benchmarks/step_timing.py
	$(PY) benchmarks/fault_tolerance.py
	$(PY) benchmarks/data_resume.py
	$(PY) benchmarks/control_plane.py --plot docs/control_plane.png
	$(MAKE) --no-print-directory env-ft
	"$$($(BACKEND_ENV) ft --path)/bin/python" benchmarks/slow_links.py   # root: network namespaces and tc
	$(PY) benchmarks/slow_links.py --plot docs/slow_links_benchmark.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
