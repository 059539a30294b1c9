# Engine lanes: fabriclite under the engines users scale on, each for real and in its own lane:
#   slurm     Debian's slurm-wlm + munge, a 3-node cluster on this machine (needs root; skips with one line otherwise)
#   torchrun  torch's elastic agent (torchrun, c10d rendezvous), the main .venv
#   ray       Ray Train (ray[train], own venv cached under $(FABRICLITE_CACHE))
#
#   make env-engine-<lane>    build / install one lane's environment (cached; scripts/engines/<lane>.sh)
#   make test-engine-<lane>   run one lane's tests (tests/integration/engines/lane_<lane>)
#   make test-engines         CI=true: build what is missing and run every lane; otherwise run the lanes whose
#                             environment is ready and say why each other one is skipped. Ends with a summary
#                             (also in build/test-log/engines.summary: `make test` prints it again last;
#                             each lane's output also in build/test-log/lane-<lane>.log).
#   make bench-engines        each engine's recovery in parts (benchmarks/engines.py -> benchmarks/results/engines.md;
#                             an engine that cannot run here is skipped with its line; SLURM needs root)
# Each lane script takes: (no flag) build | --check (exit 0 when ready, 1 when not built, 3 when it cannot run
# here at all, e.g. the slurm lane as non-root: skipped with its --why line even in CI) | --why (one line) | --python (the
# interpreter the lane's tests run with). Included by the main Makefile.

ENGINE_LANES := slurm torchrun ray
ENGINE_ENV = bash scripts/engines/$(1).sh
ENGINE_PYTEST = PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} FABRICLITE_ENGINE=$(1) $(2) -m pytest -q -p no:cacheprovider tests/integration/engines/lane_$(1)

.PHONY: test-engines bench-engines $(ENGINE_LANES:%=env-engine-%) $(ENGINE_LANES:%=test-engine-%)

bench-engines: venv
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) benchmarks/engines.py

$(ENGINE_LANES:%=env-engine-%): venv
	$(call ENGINE_ENV,$(@:env-engine-%=%))

$(ENGINE_LANES:%=test-engine-%): venv
	@lane=$(@:test-engine-%=%); $(call ENGINE_ENV,$$lane) --check || { echo "$$lane engine lane: $$($(call ENGINE_ENV,$$lane) --why); run 'make env-engine-$$lane'"; exit 1; }
	$(call ENGINE_PYTEST,$(@:test-engine-%=%),"$$($(call ENGINE_ENV,$(@:test-engine-%=%)) --python)")

test-engines: venv
	@failed=""; summary=""; ran=0; t_all=$$(date +%s); mkdir -p $(TEST_LOG); \
	for lane in $(ENGINE_LANES); do \
	  $(call ENGINE_ENV,$$lane) --check; code=$$?; \
	  if [ $$code -ne 0 ]; then \
	    why=$$($(call ENGINE_ENV,$$lane) --why); \
	    if [ $$code -eq 3 ]; then \
	      echo "== $$lane engine lane skipped: $$why"; summary="$$summary\n==   $$lane: SKIPPED: $$why"; continue; fi; \
	    if [ "$$CI" = "true" ]; then \
	      start=$$(date +%s); \
	      if ! $(MAKE) --no-print-directory env-engine-$$lane; then \
	        failed="$$failed env-engine-$$lane"; summary="$$summary\n==   $$lane: FAILED: its environment did not build ($$why)"; \
	        continue; \
	      fi; \
	      echo "== env-engine-$$lane built in $$(( $$(date +%s) - start )) s"; \
	    else \
	      echo "== $$lane engine lane skipped: $$why; 'make env-engine-$$lane' builds it (once, cached)"; \
	      summary="$$summary\n==   $$lane: SKIPPED: $$why ('make env-engine-$$lane' builds it; CI=true builds it here)"; \
	      continue; \
	    fi; \
	  fi; \
	  start=$$(date +%s); ran=$$((ran + 1)); \
	  { $(MAKE) --no-print-directory test-engine-$$lane; echo $$? > $(TEST_LOG)/lane-$$lane.rc; } 2>&1 | tee $(TEST_LOG)/lane-$$lane.log; \
	  if [ "$$(cat $(TEST_LOG)/lane-$$lane.rc)" = 0 ]; then result="ran, passed"; \
	  else failed="$$failed test-engine-$$lane"; result="ran, FAILED"; fi; \
	  took=$$(( $$(date +%s) - start )); \
	  echo "== $$lane engine lane took $$took s"; \
	  summary="$$summary\n==   $$lane: $$result ($$took s)"; \
	done; \
	{ echo "== engine lanes ($$ran of $(words $(ENGINE_LANES)) ran, $$(( $$(date +%s) - t_all )) s):"; printf '%b\n' "$$summary" | sed '/^$$/d'; \
	  if [ "$$ran" -lt $(words $(ENGINE_LANES)) ]; then echo "== NOT a full run: the skipped engine lanes were not tested"; fi; \
	  if [ -n "$$failed" ]; then echo "== engine lanes failed:$$failed"; for f in $$failed; do l=$${f#test-}; l=$${l#engine-}; grep -E "^(FAILED|ERROR) " $(TEST_LOG)/lane-$$l.log 2>/dev/null | cut -c1-240 | head -8 | sed "s/^/==     $$l: /"; done; fi; } | tee $(TEST_LOG)/engines.summary; \
	if [ -n "$$failed" ]; then exit 1; fi
