# make demo / make test work on a fresh machine: each creates .venv and installs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Which faiss wheel the venv holds (pyproject's extras cpu and gpu, never both): `make install-gpu`
# records gpu here, so a later reinstall (pyproject.toml changed) keeps faiss-gpu.
FAISS ?= $(shell cat $(VENV)/.faiss 2>/dev/null || echo cpu)
export MEMSERVER_HOME ?= $(CURDIR)/.memserver

.PHONY: install install-gpu browser demo test test-gpu gpu-wheels lint proto bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned to 2.13.0 (the CPU wheel on this machine); pip resolves the rest from pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev,$(FAISS)]'
	echo $(FAISS) > $(VENV)/.faiss
	# the shards' numba kernels compiled once into numba's cache (~30 s), not at each shard's first start
	$(BIN)/python -m memserver.core.warmup
	touch $(STAMP)

# A GPU node: the same install with faiss-gpu in place of faiss-cpu (both ship the module `faiss`,
# so a CPU one goes first). torch stays the node's own CUDA build: torch==2.13.0 is satisfied by
# 2.13.0+cuXXX, so install that build before `make install-gpu` (docs/deploy.md, "A GPU node").
install-gpu:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make install-gpu: torch sees no CUDA device: install the CUDA build of torch 2.13.0 first (docs/deploy.md)')"
	$(BIN)/python -m pip uninstall --quiet --yes faiss-cpu || true
	rm -f $(STAMP)
	$(MAKE) install FAISS=gpu

demo: install
	$(BIN)/memserver down >/dev/null 2>&1 || true
	$(BIN)/memserver up --detach --shards 2
	$(BIN)/python -m memserver.demo; status=$$?; $(BIN)/memserver down; exit $$status

# A chromium for the headless-browser tests (Playwright drives Debian's system chromium; its own
# browser download is not reachable). Never fails: without a chromium those tests skip themselves.
browser:
	@if command -v chromium >/dev/null 2>&1; then \
		:; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's chromium for the browser tests"; \
		out=$$( { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } 2>&1 ) \
			|| { echo "$$out" | tail -n 3; echo "note: could not install chromium (apt-get failed); the browser test will be skipped"; }; \
	else \
		echo "note: no chromium and cannot apt-get install it (need root + apt-get); the browser test will be skipped"; \
	fi

# The suite on TEST_WORKERS processes (pytest-xdist), each test file whole on one of them: half
# its time waits on other processes (Ray, `memserver up`, network namespaces, deadlines), so two
# on 2 cores take ~14 minutes where one took 17-19. Each worker starts its own Ray cluster.
TEST_WORKERS ?= 2

test: install browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The GPU tests alone (tests/gpu; every one skips, saying why, where torch sees no CUDA device).
test-gpu: install
	$(BIN)/python -m pytest -m gpu tests/gpu -v

# The wheels a lent GPU machine (the device tool: its image has CUDA torch but older or no gRPC
# packages) needs to run tests/gpu, for its Python 3.12 on x86-64, in .whl/ (the versions this
# venv runs), py-spy for benchmarks.gpu_profile and Ray (tests/gpu/pack_ray.py): tests/gpu/device_run.sh.
gpu-wheels: install
	rm -rf .whl && $(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(BIN)/python -c "import grpc, google.protobuf as p; v = grpc.__version__; print(f'grpcio=={v} grpcio-health-checking=={v} grpcio-reflection=={v} protobuf=={p.__version__}')")
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d .whl \
		py-spy==$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('py-spy'))")
	# faiss-cpu (19 MB; faiss-gpu's 135 MB and its CUDA 12 runtime exceed a call's carry): local KIF on
	# the GPU and an index table's CPU fallback on a GPU shard run there
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl faiss-cpu==$$($(BIN)/python -c "import faiss; print(faiss.__version__)")
	# Ray without what a shard actor never loads, as a 19.8 MiB xz tarball (its 75.6 MiB wheel exceeds a
	# call's carry), and jsonschema, its one need the image lacks: the Ray-actor GPU test runs there
	$(BIN)/python -m tests.gpu.pack_ray .whl

lint: install
	$(BIN)/ruff check .

proto: install
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/memserver/api/v1/memserver.proto

bench: install
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .memserver *.egg-info
