# Two commands: `make demo` and `make test` (`make test-fast`: the unit tests alone). Each does all
# set-up first (a .venv, the package installed editable, the gRPC stubs generated from proto/, the
# Foundry toolchain from the npm lockfile and the compiled contracts) and re-runs only what changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
STUBS  := proto/dilocox_pb2.py proto/dilocox_pb2_grpc.py
NODE_STAMP := contracts/node_modules/.installed
ARTIFACTS  := contracts/out/ContributionLedger.sol/ContributionLedger.json contracts/out/WorkerRegistry.sol/WorkerRegistry.json
FORGE      := node_modules/.bin/forge

export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# The Foundry binaries in contracts/package-lock.json are the linux-amd64 builds (anvil, forge, cast).
PLATFORM := $(shell uname -s)-$(shell uname -m)

.PHONY: all platform setup stubs demo test test-fast clean

all: setup

platform:
	@case "$(PLATFORM)" in Linux-x86_64) ;; *) echo "dilocox needs Linux on x86-64 (its Foundry binaries are the linux-amd64 builds); this is $(PLATFORM)" >&2; exit 1;; esac
	@$(PYTHON) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else 1)' 2>/dev/null || { echo "dilocox needs Python 3.11 to 3.13 as $(PYTHON) (make PYTHON=... to choose another)" >&2; exit 1; }
	@command -v npm >/dev/null || { echo "dilocox needs Node.js and npm (for the Foundry toolchain in contracts/package-lock.json)" >&2; exit 1; }

$(PY): | platform
	@echo "set-up 1/5: a Python virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the dependency list changes. pip says each package it collects and installs
# (a bar per download on a terminal): the first time takes minutes (torch alone is large).
# --no-compile: Python compiles a module's bytecode when it is first imported and keeps it, so only
# the modules the project imports are ever compiled, not every module of every package (torch's).
$(STAMP): pyproject.toml | $(PY)
	@echo "set-up 2/5: the Python packages (pip install -e '.[test]'; minutes on a fresh machine)"
	$(PY) -m pip install --no-compile -e '.[test]'
	touch $@

$(STUBS) &: proto/dilocox.proto $(STAMP)
	@echo "set-up 3/5: the gRPC stubs from proto/dilocox.proto"
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/dilocox.proto

stubs: $(STUBS)

# anvil, forge, cast and solc-js come from contracts/package-lock.json; forge runs from contracts/
# because foundry.toml names the solc-js wrapper by a relative path.
$(NODE_STAMP): contracts/package-lock.json | platform
	@echo "set-up 4/5: the Foundry toolchain (anvil, forge, solc-js) from contracts/package-lock.json (npm ci)"
	cd contracts && npm ci --no-audit --no-fund --progress=true
	touch $@

$(ARTIFACTS) &: $(NODE_STAMP) $(wildcard contracts/src/*.sol contracts/test/*.sol) contracts/foundry.toml
	@echo "set-up 5/5: the contracts (forge build)"
	cd contracts && $(FORGE) build

# The Python packages and the Foundry toolchain (then the contracts) are independent: a sub-make
# builds them side by side (-j2), so the contracts compile while pip unpacks (a fresh set-up: 40 s -> 25 s).
setup: platform
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(STUBS) $(ARTIFACTS)

demo: setup
	$(VENV)/bin/dilocox demo

# The suite runs on TEST_WORKERS pytest processes (pytest-xdist): one pytest keeps about one core
# busy (most of its time goes to the processes a test starts, one after another), so two keep both
# cores of a 2-core machine busy. --dist loadfile keeps each test module on one of them, so a
# module's shared fixtures (a finished run, a chain) are built once. --no-loadscope-reorder hands the
# modules out in collection order, the integration modules first and the many short unit modules
# last, where they fill in: xdist's default (most tests first) left a one-test module of a minute
# (the ablation smoke) for the end, with the other pytest idle behind it. The tests marked `alone`
# measure a rate on this machine and run afterwards, by themselves. --durations: the slowest tests.
TEST_WORKERS ?= 2

test: setup
	cd contracts && $(FORGE) test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone" --durations=10
	$(PY) -m pytest -q -m alone --durations=3

# The unit tests alone (pure logic: no cluster, no chain): the loop to run while editing.
test-fast: setup
	$(PY) -m pytest -q tests/unit

clean:
	rm -rf $(VENV) $(STUBS) proto/dilocox_pb2.pyi runs .pytest_cache contracts/node_modules contracts/out contracts/cache
