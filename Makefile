# The two README commands. Each creates .venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

DEMO_DIR ?= /tmp/jax-ckpt-demo

demo: $(STAMP)
	$(PY) examples/quickstart.py
	rm -rf $(DEMO_DIR)
	$(PY) examples/train.py --dir $(DEMO_DIR) --steps 20
	$(PY) examples/train.py --dir $(DEMO_DIR) --steps 40 --resume --mesh 2x4
	$(VENV)/bin/ckpt ls $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m ckpt.bench --gib 2

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
