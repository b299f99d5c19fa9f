# epick — two commands: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install proto policies bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## proto: regenerate the gRPC stubs from proto/ (committed; never hand-edited)
proto: $(STAMP)
	$(PY) -m epick.api.protogen

## policies: build every policies/*/ Zig or C source into policies/*.wasm
policies: $(STAMP)
	$(PY) -m epick.policies_build

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/epick demo

clean:
	rm -rf $(VENV) .pytest_cache
