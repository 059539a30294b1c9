# fabriclite: `make demo` runs the example, `make test` runs the tests (core suite, backend lanes, engine lanes; it
# ends with each part's time and the 15 slowest core tests). Both bootstrap .venv on first use.
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

# `make test`'s record, in $(TEST_LOG): each pytest run's output (<part>.log) and summary (<part>.summary), printed
# again as the last lines of `make test`: each part's result and time, the slowest core tests, each lane's time.
TEST_LOG := build/test-log
CORE_DURATIONS := 15
CORE_TESTS ?= tests
#: test-core's log and summary names ($(TEST_LOG)/$(CORE_PART).log, .summary, .slowest) and its summary's label
CORE_PART ?= core
CORE_LABEL ?= core suite
STRIP_COLOR := sed 's/\x1b\[[0-9;]*m//g'

# the core suite (CORE_TESTS), its CORE_DURATIONS slowest tests (pytest's --durations) and its time in
# $(TEST_LOG)/$(CORE_PART).summary (the slowest alone also in .slowest)
test-core: venv
	@mkdir -p $(TEST_LOG); start=$$(date +%s); color=auto; [ -t 1 ] && color=yes; log=$(TEST_LOG)/$(CORE_PART); \
	echo "$(PY) -m pytest -q --durations=$(CORE_DURATIONS) $(CORE_TESTS)"; \
	{ $(PY) -u -m pytest -q --color=$$color --durations=$(CORE_DURATIONS) $(CORE_TESTS); echo $$? > $$log.rc; } 2>&1 \
	  | tee $$log.log; \
	rc=$$(cat $$log.rc 2>/dev/null || echo 1); took=$$(( $$(date +%s) - start )); \
	counts=$$($(STRIP_COLOR) $$log.log | grep -E '^[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|^no tests ran' | tail -1); \
	if [ "$$rc" = 0 ]; then result=passed; else result="FAILED (pytest exit $$rc)"; fi; \
	$(STRIP_COLOR) $$log.log | awk '/slowest [0-9]+ durations/ {on = 1; next} on && /^[0-9.]+s (setup|call|teardown) / {print "==   " $$0; next} on {on = 0}' > $$log.slowest; \
	{ echo "== $(CORE_LABEL): $$result in $$took s: $${counts:-no count line (see $$log.log)}"; \
	  echo "== the $(CORE_DURATIONS) slowest core tests:"; cat $$log.slowest; } > $$log.summary; \
	exit $$rc

# `make test`: two test processes at once, at most (the lanes mostly wait: process start-up, sleeps, timeouts):
# - the first: the core suite's integration tests, printed live ($(TEST_LOG)/core-integration.log);
# - the second, beside it: the lanes, one after another (backend lanes, then engine lanes: BACKEND_LANES and
#   ENGINE_LANES, each lane's output in $(TEST_LOG)/lane-<lane>.log), then the core suite's unit tests
#   (core-unit.log), which balance the two. Its output ($(TEST_LOG)/second.log) is printed once the first has
#   ended, then followed live.
# What the two could share is kept apart: free_port (tests/support/helpers.py) picks from FL_TEST_PORTS, a range of
# each process's own; the lanes' other ports come from bind(0) (the kernel's ephemeral range, above both); every
# network namespace, /etc/netns entry and SLURM hosts line is named after the pytest process that made it; each
# pytest session has its own temporary folder. (The second starts with SIGINT and SIGQUIT at their defaults, not
# ignored as for a background job: its tests send SIGINT to the jobs they start.)
# Each part runs whatever another's result; `make test` fails if any part failed. Its last lines: each part's
# result and time, the 15 slowest core tests of both, each lane's time.
CORE_PORTS := 20000-25999
SECOND_PORTS := 26000-31999
CORE_FIRST_TESTS ?= tests --ignore=tests/unit
CORE_SECOND_TESTS ?= tests/unit
test: venv
	@rm -rf $(TEST_LOG); mkdir -p $(TEST_LOG); start=$$(date +%s); failed=""; \
	echo "== make test: the core suite's integration tests (below) beside the lanes, then the unit tests (their output: $(TEST_LOG)/second.log, printed after)"; \
	FL_TEST_PORTS=$(SECOND_PORTS) env --default-signal=INT,QUIT sh -c 't0=$$(date +%s); failed=""; \
	  for part in test-backends test-engines; do $(MAKE) --no-print-directory $$part || failed="$$failed $$part"; done; \
	  $(MAKE) --no-print-directory test-core CORE_TESTS="$(CORE_SECOND_TESTS)" CORE_PART=core-unit \
	    CORE_LABEL="core suite, unit tests (after the lanes)" || failed="$$failed test-core(unit)"; \
	  echo "$$(( $$(date +%s) - t0 ))$$failed" > $(TEST_LOG)/second.result' > $(TEST_LOG)/second.log 2>&1 & second=$$!; \
	FL_TEST_PORTS=$(CORE_PORTS) $(MAKE) --no-print-directory test-core CORE_TESTS="$(CORE_FIRST_TESTS)" \
	  CORE_PART=core-integration CORE_LABEL="core suite, integration tests (beside the lanes)" \
	  || failed=" test-core(integration)"; \
	first_took=$$(( $$(date +%s) - start )); \
	echo; echo "== the integration tests ended after $$first_took s; the lanes and the unit tests (started beside them) follow: $(TEST_LOG)/second.log"; \
	tail -n +1 --pid=$$second -f $(TEST_LOG)/second.log; wait $$second; \
	if [ -s $(TEST_LOG)/second.result ]; then read -r second_took second_failed < $(TEST_LOG)/second.result; \
	else second_took="?"; second_failed="lanes-and-unit-tests(ended-before-their-result)"; fi; \
	[ -z "$$second_failed" ] || failed="$$failed $$second_failed"; \
	{ for part in core-integration core-unit; do \
	    head -1 $(TEST_LOG)/$$part.summary 2>/dev/null || echo "== $$part: no summary (it ended before writing one; see $(TEST_LOG))"; \
	  done; \
	  echo "== the $(CORE_DURATIONS) slowest core tests:"; \
	  cat $(TEST_LOG)/core-integration.slowest $(TEST_LOG)/core-unit.slowest 2>/dev/null | sort -k2,2gr | head -$(CORE_DURATIONS); \
	} > $(TEST_LOG)/core.summary; \
	echo; echo "== make test: summary (two processes side by side: the integration tests $$first_took s; the lanes, then the unit tests $$second_took s)"; \
	for part in core backends engines; do \
	  cat $(TEST_LOG)/$$part.summary 2>/dev/null || echo "== $$part: no summary (it ended before writing one; see $(TEST_LOG))"; \
	done; \
	if [ -n "$$failed" ]; then echo "== make test FAILED ($$(( $$(date +%s) - start )) s):$$failed"; exit 1; fi; \
	echo "== make test passed ($$(( $$(date +%s) - start )) s)"

# the core suite 3 times in a row, 2 busy processes loading the CPUs, no retries (STRESS_TESTS: a subset): every run
# is made, each prints its counts, the last line the totals
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
	$(PY) benchmarks/network_faults.py   # root: network namespaces and tc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
