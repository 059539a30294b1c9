# Backend lanes: Horovod (own venv, torch 2.13.0 + horovod 0.28.1 built from source), XLA (own venv, torch 2.9.1 +
# torch_xla 2.9.0, PJRT_DEVICE=CPU), MPI (Debian OpenMPI + the main .venv) and ft (own venv, torch 2.13.0 +
# torchft 0.2.0: `fabriclite run --fault-tolerant`) and data (own venv, torch 2.13.0 + litdata 0.2.76,
# mosaicml-streaming 0.13.0, webdataset 1.0.2). Included by the main Makefile.
#
#   make env-horovod | env-xla | env-mpi | env-ft | env-data   build one lane's environment (cached under $(FABRICLITE_CACHE))
#   make test-horovod | test-xla | test-mpi | test-ft | test-data   run one lane (its environment must exist)
#   make test-backends                        CI=true: build what is missing and run every lane;
#                                             otherwise: run the lanes whose environment is cached, and for each
#                                             other lane print one line saying why it is skipped and how to build it.
#                                             Either way it ends with a summary: each lane ran (passed / FAILED, its
#                                             time) or was skipped and why, and "NOT a full run" when any was skipped
#                                             (also in build/test-log/backends.summary: `make test` prints it again last;
#                                             each lane's output also in build/test-log/lane-<lane>.log).
# A failing lane fails test-backends (after the other lanes have run), and so `make test`; the summary names its
# failing tests (its pytest FAILED and ERROR lines).

BACKEND_ENV := bash scripts/backend_env.sh
BACKEND_LANES := horovod xla mpi ft data
export FABRICLITE_CACHE ?= $(HOME)/.cache/fabriclite
# Lane tests run this checkout's code whatever checkout the cached venv was installed from.
LANE_PYTEST = PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} FABRICLITE_LANE=$(1) $(2) -m pytest -q -p no:cacheprovider tests/integration/backends/lane_$(1)

.PHONY: env-horovod env-xla env-mpi env-ft env-data test-horovod test-xla test-mpi test-ft test-data test-backends

env-horovod env-xla env-mpi env-ft env-data:
	$(BACKEND_ENV) $(@:env-%=%)

test-horovod:
	@$(BACKEND_ENV) horovod --check || { echo "horovod lane: environment missing; run 'make env-horovod'"; exit 1; }
	$(call LANE_PYTEST,horovod,"$$($(BACKEND_ENV) horovod --path)/bin/python")

test-xla:
	@$(BACKEND_ENV) xla --check || { echo "xla lane: environment missing; run 'make env-xla'"; exit 1; }
	$(call LANE_PYTEST,xla,"$$($(BACKEND_ENV) xla --path)/bin/python")

test-ft:
	@$(BACKEND_ENV) ft --check || { echo "ft lane: environment missing; run 'make env-ft'"; exit 1; }
	$(call LANE_PYTEST,ft,"$$($(BACKEND_ENV) ft --path)/bin/python")

test-data:
	@$(BACKEND_ENV) data --check || { echo "data lane: environment missing; run 'make env-data'"; exit 1; }
	$(call LANE_PYTEST,data,"$$($(BACKEND_ENV) data --path)/bin/python")

test-mpi: venv
	@$(BACKEND_ENV) mpi --check || { echo "mpi lane: OpenMPI missing; run 'make env-mpi'"; exit 1; }
	$(call LANE_PYTEST,mpi,$(PY))

test-backends: venv
	@failed=""; summary=""; ran=0; t_all=$$(date +%s); mkdir -p $(TEST_LOG); \
	for lane in $(BACKEND_LANES); do \
	  if ! $(BACKEND_ENV) $$lane --check; then \
	    why=$$($(BACKEND_ENV) $$lane --why); \
	    if [ "$$CI" = "true" ]; then \
	      start=$$(date +%s); \
	      if ! $(MAKE) --no-print-directory env-$$lane; then \
	        failed="$$failed env-$$lane"; summary="$$summary\n==   $$lane: FAILED: its environment did not build ($$why)"; \
	        continue; \
	      fi; \
	      echo "== env-$$lane built in $$(( $$(date +%s) - start )) s"; \
	    else \
	      echo "== $$lane lane skipped: $$why; 'make env-$$lane' builds it (once, cached)"; \
	      summary="$$summary\n==   $$lane: SKIPPED: $$why ('make env-$$lane' builds it; CI=true builds it here)"; \
	      continue; \
	    fi; \
	  fi; \
	  start=$$(date +%s); ran=$$((ran + 1)); \
	  { $(MAKE) --no-print-directory test-$$lane; echo $$? > $(TEST_LOG)/lane-$$lane.rc; } 2>&1 | tee $(TEST_LOG)/lane-$$lane.log; \
	  if [ "$$(cat $(TEST_LOG)/lane-$$lane.rc)" = 0 ]; then result="ran, passed"; \
	  else failed="$$failed test-$$lane"; result="ran, FAILED"; fi; \
	  took=$$(( $$(date +%s) - start )); \
	  echo "== $$lane lane took $$took s"; \
	  summary="$$summary\n==   $$lane: $$result ($$took s)"; \
	done; \
	{ echo "== backend lanes ($$ran of $(words $(BACKEND_LANES)) ran, $$(( $$(date +%s) - t_all )) s):"; printf '%b\n' "$$summary" | sed '/^$$/d'; \
	  if [ "$$ran" -lt $(words $(BACKEND_LANES)) ]; then echo "== NOT a full run: the skipped lanes' backends were not tested"; fi; \
	  if [ -n "$$failed" ]; then echo "== backend lanes failed:$$failed"; for f in $$failed; do l=$${f#test-}; l=$${l#engine-}; grep -E "^(FAILED|ERROR) " $(TEST_LOG)/lane-$$l.log 2>/dev/null | cut -c1-240 | head -8 | sed "s/^/==     $$l: /"; done; fi; } | tee $(TEST_LOG)/backends.summary; \
	if [ -n "$$failed" ]; then exit 1; fi
