# dflash-iree: `make setup`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test clean

setup: $(VENV)/.installed

# pip (not uv/poetry): on these machines pip takes the CPU build of torch from local disk.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[compile,test]'
	touch $@

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info

# Rebuild the committed top-K kernel objects (kernels/objects/) with the pinned clang-19.
.PHONY: kernels
kernels: setup
	$(PY) -m dflash_iree.kernels.build
