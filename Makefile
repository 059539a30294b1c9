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

# `make test`'s record: the core suite's output (core.log) and each part's summary (core / backends / engines
# .summary), printed again as the last lines of `make test`: the parts' times and the slowest core tests.
TEST_LOG := build/test-log
CORE_DURATIONS := 15
CORE_TESTS ?= tests

# the core suite, its CORE_DURATIONS slowest tests (pytest's --durations) and its time in $(TEST_LOG)/core.summary
test-core: venv
	@mkdir -p $(TEST_LOG); start=$$(date +%s); color=auto; [ -t 1 ] && color=yes; \
	echo "$(PY) -m pytest -q --durations=$(CORE_DURATIONS) $(CORE_TESTS)"; \
	{ $(PY) -u -m pytest -q --color=$$color --durations=$(CORE_DURATIONS) $(CORE_TESTS); echo $$? > $(TEST_LOG)/core.rc; } 2>&1 \
	  | tee $(TEST_LOG)/core.log; \
	rc=$$(cat $(TEST_LOG)/core.rc 2>/dev/null || echo 1); took=$$(( $$(date +%s) - start )); \
	counts=$$(sed 's/\x1b\[[0-9;]*m//g' $(TEST_LOG)/core.log | grep -E '^[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|^no tests ran' | tail -1); \
	if [ "$$rc" = 0 ]; then result=passed; else result="FAILED (pytest exit $$rc)"; fi; \
	{ echo "== core suite: $$result in $$took s: $${counts:-no count line (see $(TEST_LOG)/core.log)}"; \
	  echo "== the $(CORE_DURATIONS) slowest core tests:"; \
	  sed 's/\x1b\[[0-9;]*m//g' $(TEST_LOG)/core.log | awk '/slowest [0-9]+ durations/ {on = 1; next} on && /^[0-9.]+s (setup|call|teardown) / {print "==   " $$0; next} on {on = 0}'; \
	} > $(TEST_LOG)/core.summary; \
	exit $$rc

# `make test`: two parts side by side, at most 2 test processes at once (the lanes mostly wait: process start-up,
# sleeps, timeouts): the core suite, printed live (core.log), and beside it the lanes, one after another (backend
# lanes, then engine lanes; each lane's output in $(TEST_LOG)/lane-<lane>.log, the whole part's in lanes.log,
# printed once the core suite has ended, then followed live). What they could share is kept apart: free_port
# (tests/support/helpers.py) picks from FL_TEST_PORTS, a range of each part's own; the lanes' other ports come from
# bind(0) (the kernel's ephemeral range, above both); every network namespace, /etc/netns entry and SLURM hosts line
# is named after the pytest process that made it; each pytest session has its own temporary folder.
# Each part runs whatever the other's result; `make test` fails if any part failed. Its last lines: each part's
# result and time, the slowest core tests, each lane's time. (The lanes start with SIGINT and SIGQUIT at their
# defaults, not ignored as for a background job: their tests send SIGINT to jobs they start.)
CORE_PORTS := 20000-25999
LANE_PORTS := 26000-31999
test: venv
	@rm -rf $(TEST_LOG); mkdir -p $(TEST_LOG); start=$$(date +%s); failed=""; \
	echo "== make test: the core suite (below) beside the lanes (one after another; $(TEST_LOG)/lanes.log, printed when the core suite ends)"; \
	FL_TEST_PORTS=$(LANE_PORTS) env --default-signal=INT,QUIT sh -c 't0=$$(date +%s); failed=""; \
	  for part in test-backends test-engines; do $(MAKE) --no-print-directory $$part || failed="$$failed $$part"; done; \
	  echo "$$(( $$(date +%s) - t0 ))$$failed" > $(TEST_LOG)/lanes.result' > $(TEST_LOG)/lanes.log 2>&1 & lanes=$$!; \
	FL_TEST_PORTS=$(CORE_PORTS) $(MAKE) --no-print-directory test-core || failed=" test-core"; \
	core_took=$$(( $$(date +%s) - start )); \
	echo; echo "== the core suite ended after $$core_took s; the lanes (started beside it) follow: $(TEST_LOG)/lanes.log"; \
	tail -n +1 --pid=$$lanes -f $(TEST_LOG)/lanes.log; wait $$lanes; \
	if [ -s $(TEST_LOG)/lanes.result ]; then read -r lanes_took lanes_failed < $(TEST_LOG)/lanes.result; \
	else lanes_took="?"; lanes_failed="lanes(ended-before-their-result)"; fi; \
	[ -z "$$lanes_failed" ] || failed="$$failed $$lanes_failed"; \
	echo; echo "== make test: summary (the core suite beside the lanes: $$core_took s and $$lanes_took s)"; \
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
