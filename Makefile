# Two commands: `make demo` and `make test`. Each does all set-up first (a .venv, the package
# installed editable, the gRPC stubs generated from proto/) and re-runs only what changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
STUBS  := proto/dilocox_pb2.py proto/dilocox_pb2_grpc.py

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

setup: $(STAMP) $(STUBS)

demo: setup
	$(VENV)/bin/dilocox demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(STUBS) proto/dilocox_pb2.pyi runs .pytest_cache
