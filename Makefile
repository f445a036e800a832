# Everything runs in a local virtual environment (.venv) made from the machine's python3.
# torch is pinned through constraints.txt (CPU wheel; an unpinned torch pulls GBs of CUDA).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# pytest-xdist workers for `make test` (auto: one per CPU; 0 runs in this process)
TEST_WORKERS ?= auto

.PHONY: demo test test-slow lint bench vectors clean

# (not --no-compile: where PYTHONDONTWRITEBYTECODE is set, as on this project's machines,
# no run would cache what it compiles, and every process would compile torch again: a
# fresh-clone CI run took 41 min 47 s of pytest instead of 24 min 30 s)
$(STAMP): pyproject.toml constraints.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[torch,torchtitan]' -r requirements-dev.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check lowdiff_store tests tools bench examples
	$(VENV)/bin/mypy
	$(PY) tools/gen_vectors.py --check
	$(PY) -m pytest -q -m "not slow" --benchmark-disable -n $(TEST_WORKERS) --dist loadgroup \
		--durations=25; \
		rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadgroup; \
		rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

bench: $(STAMP)
	$(PY) -m pytest bench -q --benchmark-only

vectors: $(STAMP)
	$(PY) tools/gen_vectors.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
