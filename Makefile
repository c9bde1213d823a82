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

.PHONY: demo test test-ops test-programs lint bench bench-quick
demo: $(STAMP)
	$(PY) -m shoal.demo

test: $(STAMP)
	$(PY) -m pytest

# every OpInfo sample of torch's op database, more seeds (tests/test_opinfo.py; make test runs one sample per op);
# -s shows the summary of what was covered
test-ops: $(STAMP)
	SHOAL_OPINFO=full $(PY) -m pytest tests/test_opinfo.py -s

# random programs (tests/test_programs.py) with a larger budget than the default run's
test-programs: $(STAMP)
	SHOAL_PROGRAMS=$${SHOAL_PROGRAMS:-2000} $(PY) -m pytest tests/test_programs.py

lint: $(STAMP)
	.venv/bin/ruff check src tests bench

# the benchmarks of the README's tables, at their settings (many minutes on 2 cores)
bench: $(STAMP)
	$(PY) bench/eager_overhead.py
	$(PY) bench/graph_vs_eager.py
	$(PY) bench/dp_vs_ddp.py

# the same scripts in smoke runs (a few minutes): they run, the numbers mean little
bench-quick: $(STAMP)
	$(PY) bench/eager_overhead.py --iters 20 --repeats 1
	$(PY) bench/graph_vs_eager.py --quick --only A,C
	$(PY) bench/dp_vs_ddp.py --steps 2
	$(PY) bench/scaling.py --devices 1,2 --layers 2 --steps 1 --repeats 1
	$(PY) bench/pipeline.py --quick

