# The two README commands. Each creates .venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-newest test-adversarial-long docs bench bench-quick bench-memory clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

DEMO_DIR ?= /tmp/jax-ckpt-demo

demo: $(STAMP)
	$(PY) examples/quickstart.py
	rm -rf $(DEMO_DIR)
	$(PY) examples/train.py --dir $(DEMO_DIR) --steps 20
	$(PY) examples/train.py --dir $(DEMO_DIR) --steps 40 --resume --mesh 2x4
	$(VENV)/bin/ckpt ls $(DEMO_DIR)

test: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(SITE_DIR)
	$(PY) -m pytest -q tests

# The second environment (.ci/run runs both): Python 3.12 with the newest jax, jaxlib, flax, optax
# and orbax-checkpoint the registry serves, in .venv-newest (no docs tools: `make test` builds the
# site). Floated, not pinned: its purpose is to fail on what a user's `pip install` gets today, so
# each CI run (a fresh clone, a fresh venv) takes the newest releases, and prints their versions
# first so that a failure brought by a new release says which. Locally the venv is kept: `rm -rf
# .venv-newest` takes newer releases. Python 3.12 is looked for on PATH, then in pyenv
# (PYTHON_NEWEST=/path/to/python3.12 overrides).
PYTHON_NEWEST ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV_NEWEST := .venv-newest
PY_NEWEST := $(VENV_NEWEST)/bin/python
STAMP_NEWEST := $(VENV_NEWEST)/.installed
NEWEST := jax jaxlib flax optax orbax-checkpoint

$(STAMP_NEWEST): pyproject.toml
	@test -n "$(PYTHON_NEWEST)" || { echo "test-newest needs Python 3.12: none on PATH or in pyenv; set PYTHON_NEWEST=/path/to/python3.12" >&2; exit 1; }
	test -x $(PY_NEWEST) || $(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install -q --upgrade pip
	$(PY_NEWEST) -m pip install -q -e '.[test]' --upgrade $(NEWEST)
	touch $(STAMP_NEWEST)

test-newest: $(STAMP_NEWEST)
	@$(PY_NEWEST) -c "import sys, importlib.metadata as m; print('newest environment:', ', '.join([f'Python {sys.version.split()[0]}'] + [f'{p} {m.version(p)}' for p in '$(NEWEST) tensorstore zarr numpy'.split()]))"
	$(PY_NEWEST) -m pytest -q tests

# The adversarial suite at full length: every manifest field with every hostile value, every
# byte of the metadata flipped, 20000 fuzz examples, 500 concurrent steps (tests/adversarial).
test-adversarial-long: $(STAMP)
	CKPT_ADVERSARIAL=long $(PY) -m pytest -q -s tests/adversarial

SITE_DIR ?= site

# The documentation site (mkdocs.yml) into $(SITE_DIR)/; open $(SITE_DIR)/index.html.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir $(SITE_DIR)

# The developer benchmarks (bench/, not installed) run from the repository root.
bench: $(STAMP)
	$(PY) -m bench --gib 2

# The quick regression check (<= 4 minutes on the 2-core VM): every headline ratio at a small size
# against bench/baseline.json; exit status 1 when one regressed (docs/benchmarks.md, "Quick
# regression check"). Run it before resolving an issue that touches the data path.
bench-quick: $(STAMP)
	$(PY) -m bench.quick

# Peak host memory of save and restore under a host budget, each measurement in a fresh process
# (docs/benchmarks.md, "Host memory"; 15-30 minutes on the 2-core VM).
bench-memory: $(STAMP)
	$(PY) -m bench --memory --gib 2 --runs 3

clean:
	rm -rf $(VENV) $(VENV_NEWEST) build *.egg-info .pytest_cache site
