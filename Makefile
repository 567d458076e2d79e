# The two README commands. Each creates .venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-adversarial-long docs bench bench-quick bench-memory clean

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
	rm -rf $(VENV) build *.egg-info .pytest_cache site
