# Two commands: `make demo` and `make test`. Each does all set-up first (a .venv, the package
# installed editable, the gRPC stubs generated from proto/, the Foundry toolchain from the npm
# lockfile and the compiled contracts) and re-runs only what changed.

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

.PHONY: all setup stubs demo test clean

all: setup

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

$(STUBS) &: proto/dilocox.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/dilocox.proto

stubs: $(STUBS)

# anvil, forge, cast and solc-js come from contracts/package-lock.json; forge runs from contracts/
# because foundry.toml names the solc-js wrapper by a relative path.
$(NODE_STAMP): contracts/package-lock.json
	cd contracts && npm ci --no-audit --no-fund
	touch $@

$(ARTIFACTS) &: $(NODE_STAMP) $(wildcard contracts/src/*.sol contracts/test/*.sol) contracts/foundry.toml
	cd contracts && $(FORGE) build

setup: $(STAMP) $(STUBS) $(ARTIFACTS)

demo: setup
	$(VENV)/bin/dilocox demo

test: setup
	cd contracts && $(FORGE) test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(STUBS) proto/dilocox_pb2.pyi runs .pytest_cache contracts/node_modules contracts/out contracts/cache
