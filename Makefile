# burstcv: `make demo` runs the whole pipeline on this machine; `make test` runs the suite.
# Setup is idempotent: .venv is rebuilt only when a requirements file or pyproject.toml changes.

SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= $(shell command -v python3.11 || command -v python3)
REPO := $(abspath .)
VENV := $(REPO)/.venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp
VAR := $(REPO)/var
RUN := $(VAR)/run

# The burstcv home (src/burstcv/settings.py): artifact store, registry, local compute records
# and the demo data live under var/ of this checkout, whatever the working directory.
export BURSTCV_HOME := $(VAR)
export AIRFLOW_HOME := $(VAR)/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(REPO)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(REPO)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN := sqlite:///$(AIRFLOW_HOME)/airflow.db
AIRFLOW_PORT ?= 8080
export AIRFLOW__API__HOST := 127.0.0.1
export AIRFLOW__API__PORT := $(AIRFLOW_PORT)
# Tasks report to the execution API of this Airflow, on whichever port it listens.
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL := http://127.0.0.1:$(AIRFLOW_PORT)/execution/
export PYTHONUNBUFFERED := 1
# `make airflow` starts Airflow's components as `airflow ...` subprocesses
# (burstcv.airflow.standalone).
export PATH := $(BIN):$(PATH)

SERVE_PORT ?= 8000
SERVE_URL := http://127.0.0.1:$(SERVE_PORT)
export BURSTCV_SERVING_URL ?= $(SERVE_URL)
export BURSTCV_SERVING_REGISTRY_URI ?= $(VAR)/registry
export BURSTCV_SERVING_PORT ?= $(SERVE_PORT)
DEMO_DATA := $(VAR)/data/digits

# The torch-free parts (the service, the packaging checks, the DAG parse, the shared spec) also
# run on Python 3.12, the default of Airflow's official images, in a venv of their own built
# from requirements-py312.txt. PYTHON312 picks the interpreter; SKIP_PY312=1 skips that run.
PYTHON312 ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python) \
  $(shell command -v python3.12))
VENV312 := $(REPO)/.venv312
STAMP312 := $(VENV312)/.stamp
TEST312 := tests/serving tests/test_packaging.py tests/dags/test_dag_integrity.py \
  $(wildcard tests/spec tests/test_spec*.py tests/test_contracts*.py)
# pip's notes about this machine's local index folders are filtered out, not its errors.
QUIET_PIP := quiet() { "$$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

.PHONY: help setup sysdeps demo test test312 stack-test stack-env lint airflow serve stop airflow-stop serve-stop clean \
  distclean chaos mutation serve-port airflow-port

help:
	@echo "make demo   - set up, run the pipeline DAG on the demo digits, serve it, predict"
	@echo "make test   - set up and run the whole test suite (and make test312)"
	@echo "make test312 - the torch-free tests on Python 3.12, in .venv312"
	@echo "make stack-test - build the images and run docker-compose.yaml for real (podman; slow)"
	@echo "make stack-env - write .env for docker-compose.yaml, with fresh secrets"
	@echo "make lint   - ruff + mypy"
	@echo "make airflow / serve - start Airflow (restarting it when a component died) / the service"
	@echo "make airflow-stop / serve-stop / stop - stop Airflow / the service / both"
	@echo "make chaos  - inject faults into a running pipeline and say what survived (slow)"
	@echo "make mutation - mutation testing of the decision modules: score per module, survivors"
	@echo "make clean"

$(STAMP): requirements.txt serving/requirements.txt pyproject.toml
	@echo ">> building $(VENV) (requirements changed or first run; a few minutes)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(QUIET_PIP)
	quiet $(BIN)/pip install --quiet --upgrade pip
	quiet $(BIN)/pip install --quiet -r requirements.txt
	quiet $(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP) sysdeps

# Debian packages some tests and benchmarks use (headless Chromium for screenshots, wrk for
# load). Installed when missing and we may (root + apt); the tests skip cleanly without them.
sysdeps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
	  missing=""
	  command -v chromium >/dev/null || missing="$$missing chromium"
	  command -v wrk >/dev/null || missing="$$missing wrk"
	  if [ -n "$$missing" ]; then
	    echo ">> installing$$missing (Debian packages)"
	    (apt-get install -y -qq $$missing >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $$missing >/dev/null 2>&1; }) \
	      || echo ">> could not install$$missing; the tests that need them will skip"
	  fi
	fi

$(AIRFLOW_HOME)/airflow.db: $(STAMP)
	@echo ">> creating the embedded Airflow (SQLite) in $(AIRFLOW_HOME)"
	mkdir -p $(AIRFLOW_HOME)
	$(BIN)/airflow db migrate > $(AIRFLOW_HOME)/db-migrate.log 2>&1 || { tail -20 $(AIRFLOW_HOME)/db-migrate.log; exit 1; }
	$(BIN)/burstcv airflow-init >> $(AIRFLOW_HOME)/db-migrate.log 2>&1

$(DEMO_DATA): | $(STAMP)
	@$(BIN)/burstcv demo-data $(DEMO_DATA) 2>/dev/null

demo: serve-port $(STAMP) $(AIRFLOW_HOME)/airflow.db $(DEMO_DATA)
	@$(MAKE) --no-print-directory serve
	start=$$(date +%s)
	echo ">> running the burstcv_pipeline DAG once (Airflow dag.test); its tasks' log: $(RUN)/last-run.log"
	if ! $(BIN)/burstcv run --conf '{"dataset_uri": "$(DEMO_DATA)"}' > $(RUN)/demo-run.log 2>&1; then
	  tail -60 $(RUN)/demo-run.log; exit 1
	fi
	sed -n '/^burstcv_pipeline run /,$$p' $(RUN)/demo-run.log
	echo ">> DAG run took $$(( $$(date +%s) - start )) s; report: $$(ls -t $(VAR)/artifacts/runs/*/report/index.html | head -1)"
	image=$$(ls $(DEMO_DATA)/val/7/*.png | head -1)
	echo ">> predicting $$image (a validation image of class 7) with the deployed model:"
	$(BIN)/burstcv predict "$$image" --url $(SERVE_URL)

test: $(STAMP) sysdeps test312
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

# The production stack (docker-compose.yaml), built and run for real with podman: stand-in
# base images from Debian's packages, the project's images, a pipeline run through the REST
# API, a prediction through the service container (tests/stack/test_stack.py). Installs
# podman, runc and debootstrap when missing (Debian packages); layers are cached.
stack-test: $(STAMP)
	BURSTCV_STACK_TEST=1 $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/stack $(STACK_PYTEST_ARGS)

stack-env:
	@python3 docker/stack-env.py

$(STAMP312): requirements-py312.txt requirements.txt serving/requirements.txt pyproject.toml
	@if ! "$(PYTHON312)" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
	  echo ">> no Python 3.12 at PYTHON312='$(PYTHON312)': install one (pyenv install 3.12)" \
	    "and point PYTHON312 at it, or run make test SKIP_PY312=1" >&2
	  exit 1
	fi
	echo ">> building $(VENV312) for the torch-free tests on Python 3.12 (requirements changed or first run)"
	rm -rf $(VENV312)
	"$(PYTHON312)" -m venv $(VENV312)
	$(QUIET_PIP)
	quiet $(VENV312)/bin/pip install --quiet --upgrade pip
	quiet $(VENV312)/bin/pip install --quiet -r requirements-py312.txt
	# Installed as a package: pip refuses it if requires-python leaves 3.12 out.
	quiet $(VENV312)/bin/pip install --quiet --no-deps -e .
	touch $(STAMP312)

ifeq ($(SKIP_PY312),1)
test312:
	@echo ">> SKIP_PY312=1: not running the torch-free tests on Python 3.12"
else
test312: $(STAMP312)
	$(VENV312)/bin/python -m pytest -q $(TEST312) $(PYTEST312_ARGS)
endif

lint: $(STAMP)
	$(BIN)/ruff check src serving spec dags plugins tests bench
	$(BIN)/ruff format --check src serving spec dags plugins tests bench
	$(BIN)/mypy

# What answers on the port must be the process started here, reading this checkout's
# registry; a busy port stops the target at once, naming its holder (burstcv.localports).
PORTCHECK := $(BIN)/python -m burstcv.localports
SERVE_CHECK := --var SERVE_PORT --target serve --registry $(BURSTCV_SERVING_REGISTRY_URI)

# Before any setup (a fresh clone builds .venv for minutes), a busy port stops the target at
# once: the bare Python runs the same check, without naming the holder until psutil is there.
EARLY_PORTCHECK := PYTHONPATH=$(REPO)/src $$([ -x $(BIN)/python ] && echo $(BIN)/python || echo $(PYTHON)) \
  -m burstcv.localports free

# One supervisor (burstcv.supervisor) runs what `make airflow` and `make serve` start: a child
# that exits, stops or stops answering is ended with its process group and restarted. Each
# records its groups in a state file, so a stop ends them even after the supervisor died.
SUPERVISOR := $(BIN)/python -m burstcv.supervisor
SERVE_STATE := $(RUN)/serve.state.json
AIRFLOW_STATE := $(RUN)/airflow.state.json
AIRFLOW_URL := http://127.0.0.1:$(AIRFLOW_PORT)
# Whether a target's supervisor runs ($$1: serve or airflow).
define ALIVE
alive() { [ -f $(RUN)/$$1.pid ] && ps -o stat= -p $$(cat $(RUN)/$$1.pid) 2>/dev/null | grep -qv Z; }
# A supervisor that died leaves its groups recorded: they are ended before a fresh start.
orphans() {
  if ! alive $$1 && [ -f $(RUN)/$$1.state.json ] && [ -x $(BIN)/python ]; then
    $(SUPERVISOR) stop --state $(RUN)/$$1.state.json | sed "s/^>> ended/>> $$1's supervisor is gone; ended its orphaned/"
    rm -f $(RUN)/$$1.pid
  fi
}
endef

serve-port:
	@$(ALIVE)
	orphans serve
	if ! alive serve; then
	  $(EARLY_PORTCHECK) $(SERVE_PORT) --var SERVE_PORT --target serve --what "the prediction service"
	fi

airflow-port:
	@$(ALIVE)
	orphans airflow
	if ! alive airflow; then
	  $(EARLY_PORTCHECK) $(AIRFLOW_PORT) --var AIRFLOW_PORT --target airflow --what "the Airflow UI"
	fi

serve: serve-port $(STAMP)
	@mkdir -p $(RUN)
	$(ALIVE)
	if alive serve && $(SUPERVISOR) up --state $(SERVE_STATE) --within 60 > /dev/null; then
	  $(PORTCHECK) ours $(SERVE_PORT) --pid $$(cat $(RUN)/serve.pid) $(SERVE_CHECK)
	  echo ">> service already running (supervisor pid $$(cat $(RUN)/serve.pid)) on $(SERVE_URL)"; exit 0
	fi
	$(MAKE) --no-print-directory serve-stop
	$(PORTCHECK) free $(SERVE_PORT) --var SERVE_PORT --target serve --what "the prediction service"
	setsid nohup $(SUPERVISOR) run serve --state $(SERVE_STATE) >> $(RUN)/serve.log 2>&1 &
	pid=$$!
	echo $$pid > $(RUN)/serve.pid
	up=""
	for i in $$(seq 1 100); do
	  # Up once it answers and its supervisor has seen it answer (the state names its pid).
	  curl -sf $(SERVE_URL)/healthz > /dev/null && \
	    $(SUPERVISOR) up --state $(SERVE_STATE) --within 5 > /dev/null && { up=1; break; }
	  kill -0 $$pid 2>/dev/null || { tail -20 $(RUN)/serve.log; rm -f $(RUN)/serve.pid; exit 1; }
	  sleep 0.2
	done
	[ -n "$$up" ] || { echo ">> the service did not answer within 20 s:"; tail -20 $(RUN)/serve.log; $(MAKE) --no-print-directory serve-stop; exit 1; }
	$(PORTCHECK) ours $(SERVE_PORT) --pid $$pid $(SERVE_CHECK) || { $(MAKE) --no-print-directory serve-stop; exit 1; }
	echo ">> service on $(SERVE_URL) (supervisor pid $$pid, log $(RUN)/serve.log); make serve-stop ends it"

# A second `make airflow` waits (bounded) for a component the supervisor is restarting, and
# restarts Airflow alone (not the service) when one is still down, the api-server included.
airflow: airflow-port $(STAMP) $(AIRFLOW_HOME)/airflow.db
	@mkdir -p $(RUN)
	$(ALIVE)
	if alive airflow; then
	  if bad=$$($(SUPERVISOR) up --state $(AIRFLOW_STATE) --airflow $(AIRFLOW_URL) --within 120); then
	    $(PORTCHECK) ours $(AIRFLOW_PORT) --pid $$(cat $(RUN)/airflow.pid) --var AIRFLOW_PORT --target airflow
	    echo ">> Airflow already running (pid $$(cat $(RUN)/airflow.pid)), every component healthy"
	  else
	    echo ">> Airflow (pid $$(cat $(RUN)/airflow.pid)) is running but not healthy: $$bad; restarting Airflow (the service keeps running)"
	    $(MAKE) --no-print-directory airflow-stop
	  fi
	fi
	if ! alive airflow; then
	  $(PORTCHECK) free $(AIRFLOW_PORT) --var AIRFLOW_PORT --target airflow --what "the Airflow UI"
	  # Airflow's standalone set, without the log servers that bind every interface.
	  setsid nohup $(SUPERVISOR) run airflow --state $(AIRFLOW_STATE) >> $(RUN)/airflow.log 2>&1 &
	  pid=$$!
	  echo $$pid > $(RUN)/airflow.pid
	  up=""
	  bad=""
	  for i in $$(seq 1 300); do
	    # Up means every component heartbeats, not only the UI answering.
	    bad=$$($(SUPERVISOR) up --state $(AIRFLOW_STATE) --airflow $(AIRFLOW_URL) --within 0) && { up=1; break; }
	    kill -0 $$pid 2>/dev/null || { tail -40 $(RUN)/airflow.log; $(MAKE) --no-print-directory airflow-stop; exit 1; }
	    sleep 1
	  done
	  [ -n "$$up" ] || { echo ">> Airflow not healthy within 300 s ($$bad):"; tail -40 $(RUN)/airflow.log; exit 1; }
	  $(PORTCHECK) ours $(AIRFLOW_PORT) --pid $$pid --var AIRFLOW_PORT --target airflow || {
	    $(MAKE) --no-print-directory airflow-stop; exit 1; }
	fi
	echo ">> Airflow UI: $(AIRFLOW_URL)  (log $(RUN)/airflow.log; make airflow-stop ends it)"
	echo ">> login: admin / $$($(BIN)/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["admin"])' $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated)"

# Stop one thing: `make airflow-stop` leaves the prediction service serving, and `make
# serve-stop` leaves Airflow (and its runs) alone; `make stop` ends both. Each ends the
# supervisor and every process group it recorded, whether or not their leaders live.
define STOP_ONE
stop_one() {
  if [ -f $(RUN)/$$1.state.json ]; then
    $(SUPERVISOR) stop --state $(RUN)/$$1.state.json | sed "s/^>> ended/>> $$1: ended/"
  elif [ -f $(RUN)/$$1.pid ] && kill -0 $$(cat $(RUN)/$$1.pid) 2>/dev/null; then
    kill -TERM -$$(cat $(RUN)/$$1.pid) 2>/dev/null || true
    echo ">> stopped $$1 (pid $$(cat $(RUN)/$$1.pid))"
  fi
  rm -f $(RUN)/$$1.pid
}
endef

airflow-stop:
	@$(STOP_ONE)
	stop_one airflow

serve-stop:
	@$(STOP_ONE)
	stop_one serve

stop:
	@$(STOP_ONE)
	stop_one serve
	stop_one airflow

# A fault drill on a throwaway home (never var/): one pipeline run per fault, a verdict each.
chaos: $(STAMP)
	$(BIN)/python bench/chaos.py $(CHAOS_ARGS)

# Mutation testing of the modules that decide (tests/mutation/run.py's TARGETS: the gate, the
# registry and deploy, the service's admission and model manager, the reaper, EC2's terms, the
# attempts, the budget, boot, cost model, prices and billing, the sizing, the data's chunks):
# every function of each module, a score per module and the surviving mutants. Not part of
# make test (tens of minutes).
# MUTATION_ARGS="gate reaper" picks modules; --list shows the mutants without running them.
# Fails when a module's score is under 90%.
mutation: $(STAMP)
	$(BIN)/python tests/mutation/run.py --fail-under 90 $(MUTATION_ARGS)

clean: stop
	rm -rf $(VAR) .pytest_cache .ruff_cache .mypy_cache
	find . -name __pycache__ -type d -prune -not -path './.venv/*' -not -path './.venv312/*' -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VENV312)
