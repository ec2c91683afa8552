# exitplan: `make demo` runs the main job, `make test` runs the tests. Both install what they need.
# `python -P`: never put the working directory first on sys.path — the repository's operator/ folder
# (imported as exitplan.operator) would shadow the standard library's `operator` module.
VENV ?= .venv
PY := $(VENV)/bin/python
EXITPLAN := $(VENV)/bin/exitplan
ARGS ?=

.PHONY: install demo test clean lock lock-upgrade pin-images

$(VENV)/.installed: pyproject.toml
	python3 -P -m venv $(VENV)
	$(PY) -P -m pip install -q --upgrade pip
	$(PY) -P -m pip install -q -e '.[all]'
	touch $@

install: $(VENV)/.installed
	@sh tools/install-prometheus.sh

demo: install
	$(EXITPLAN) demo $(ARGS)

# The tests' S3-compatible server (moto) in a venv of its own: see tools/s3-test-server.txt.
S3_VENV ?= .venv-s3
$(S3_VENV)/.installed: tools/s3-test-server.txt
	python3 -P -m venv $(S3_VENV)
	$(S3_VENV)/bin/python -P -m pip install -q -r tools/s3-test-server.txt
	touch $@

test: install $(S3_VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -P tools/typecheck.py
	$(PY) -P -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30

clean:
	rm -rf artifacts .pytest_cache

# The images' locked dependencies (requirements/*.lock: every package pinned with its sha256 hashes, which
# the Dockerfile installs with pip --require-hashes --no-deps). `make lock` regenerates them after a change
# to pyproject.toml or requirements/tools.in and keeps the other pins; `make lock-upgrade` also moves every
# transitive dependency to its newest release. pip-tools runs in a throwaway venv ($(LOCK_VENV)), on
# CPython 3.11 for linux x86_64, the platform of the images; the machine's pip configuration (mirrors,
# find-links, constraints) is ignored so the locks resolve against the package index alone.
LOCK_PYTHON ?= python3.11
LOCK_VENV ?= /tmp/exitplan-pip-tools
PIP_TOOLS_VERSION := 7.6.2
LOCK_FLAGS ?=
PIP_COMPILE = env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe \
	--strip-extras --no-emit-index-url --no-emit-find-links $(LOCK_FLAGS)

lock:
	$(LOCK_PYTHON) -c 'import platform, sys; assert sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64", "make lock needs CPython 3.11 on linux x86_64 (set LOCK_PYTHON)"'
	test -x $(LOCK_VENV)/bin/pip-compile || { $(LOCK_PYTHON) -m venv $(LOCK_VENV) \
		&& PIP_CONFIG_FILE=/dev/null $(LOCK_VENV)/bin/pip install -q "pip-tools==$(PIP_TOOLS_VERSION)"; }
	$(PIP_COMPILE) -o requirements/tools.lock requirements/tools.in
	$(PIP_COMPILE) --extra operator -o requirements/operator.lock pyproject.toml requirements/tools.in
	$(PIP_COMPILE) --extra worker --extra operator -o requirements/worker.lock pyproject.toml requirements/tools.in

lock-upgrade:
	$(MAKE) lock LOCK_FLAGS=--upgrade

# Pin the Dockerfile's base images (the *_IMAGE build ARGs) to the digests their tags name in the registry
# now: IMAGE:TAG becomes IMAGE:TAG@sha256:DIGEST. Needs the registries (Docker Hub, nvcr.io) on the network.
pin-images:
	python3 tools/pin_images.py --dockerfile Dockerfile

# The peers' bench-only venvs (.bench-venvs/{kserve,mlserver,ray}) for bench/peers.py, from bench/peers/*.txt.
.PHONY: peers-venvs
peers-venvs:
	bash tools/peers-venvs.sh

# The GPU proof's kit (bench/gpu_kit.py): the CPython 3.12 wheels the GPU machine lacks, the MiniLM bundle and
# the trace, as parts of at most 56 MiB in .gpu-kit/ (ignored by git); `bench/gpu_kit.py plan` prints which parts
# each device call carries, and the last call runs `python3 bench/gpu_proof.py --kit .gpu-kit --out $OUT`.
.PHONY: gpu-kit
gpu-kit: install
	test -f artifacts/bundles/minilm/bundle.yaml || $(EXITPLAN) prepare
	$(PY) -P bench/gpu_kit.py build --bundle artifacts/bundles/minilm --out .gpu-kit
