# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what is needed on a fresh machine.
PY := .venv/bin/python
STAMP := .venv/.installed

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: demo test lint bench
demo: $(STAMP)
	$(PY) -m shoal.demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	.venv/bin/ruff check src tests bench examples

bench: $(STAMP)
	$(PY) bench/boxing.py
