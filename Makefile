# exitplan: `make demo` runs the main job, `make test` runs the tests. Both install what they need.
# `python -P`: never put the working directory first on sys.path — the repository's operator/ folder
# (imported as exitplan.operator) would shadow the standard library's `operator` module.
VENV ?= .venv
PY := $(VENV)/bin/python
EXITPLAN := $(VENV)/bin/exitplan
ARGS ?=

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	python3 -P -m venv $(VENV)
	$(PY) -P -m pip install -q --upgrade pip
	$(PY) -P -m pip install -q -e '.[all]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(EXITPLAN) demo $(ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -P tools/typecheck.py
	$(PY) -P -m pytest -q -p no:cacheprovider

clean:
	rm -rf artifacts .pytest_cache
