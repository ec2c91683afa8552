# exitplan: `make demo` runs the main job, `make test` runs the tests. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
EXITPLAN := $(VENV)/bin/exitplan
ARGS ?=

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(EXITPLAN) demo $(ARGS)

test: install
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf artifacts .pytest_cache
