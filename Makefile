# dflash-iree: `make demo`, `make test`; `make setup`, `make compile`, `make records`, `make kernels`,
# `make device-wheels`, `make device-artifacts`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo clean

setup: $(VENV)/.installed

# pip (not uv/poetry): on these machines pip takes the CPU build of torch from local disk.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[compile,test]'
	touch $@

test: setup
	$(PY) -m pytest -q

# Compile the demo pair for the host CPU (once; again when a source or the pair changes), then decode a
# held-out code prompt plain and with DFlash: the text, tau and tok/s of each. `make demo PAIR=qwen35`
# does the same with the hybrid pair models/demo-qwen35 (Gated DeltaNet target), compiled into
# compiled/host-qwen35 so that the two pairs' artifacts sit side by side (train/README.md, "The
# hybrid demo pair").
PAIR ?=
DEMO_MODELS := models/demo$(if $(PAIR),-$(PAIR))
DEMO_OUT := compiled/host$(if $(PAIR),-$(PAIR))
DEMO_ARTIFACTS := $(DEMO_OUT)/manifest.json
$(DEMO_ARTIFACTS): $(VENV)/.installed $(wildcard export/*.py kernels/*.py kernels/*/*.py kernels/objects/* dflash_iree/arch.py dflash_iree/config.py $(if $(PAIR),dflash_iree/config_qwen35.py) dflash_iree/manifest.py $(DEMO_MODELS)/*/config.json)
	$(PY) -m dflash_iree compile --arch host --target $(DEMO_MODELS)/target --drafter $(DEMO_MODELS)/drafter $(if $(PAIR),--out $(DEMO_OUT))

demo: $(DEMO_ARTIFACTS)
	$(PY) -m dflash_iree demo --artifacts $(DEMO_OUT)

clean:
	rm -rf $(VENV) build *.egg-info

# Rebuild the committed kernel objects (top-K, skinny GEMM, block attention, norm + rope) (kernels/objects/) with the pinned clang-19.
.PHONY: kernels
kernels: setup
	$(PY) -m dflash_iree.kernels.build

# `make compile ARCH=gfx1151 [TARGET=dir DRAFTER=dir OUT=dir DRAFT_TOP_K=K COMPILE_ARGS="--block-size 8"]`:
# export the pair and compile it for one arch into compiled/ARCH (dflash.vmfb + manifest.json). Reads
# only the two config.json files. ARCH: host gfx1030 gfx1100 gfx1151 gfx1201 sm_80 sm_86 sm_89 (or an
# alias). DRAFT_TOP_K: K of the draft_topk entry point, 1..64 (default 8), 0 for none.
ARCH ?= host
TARGET ?= models/demo/target
DRAFTER ?= models/demo/drafter
.PHONY: compile records
compile: setup
	$(PY) -m dflash_iree compile --arch $(ARCH) --target $(TARGET) --drafter $(DRAFTER) $(if $(OUT),--out $(OUT)) $(if $(DRAFT_TOP_K),--draft-top-k $(DRAFT_TOP_K)) $(COMPILE_ARGS)

# Rewrite compiled/records/ARCH.json (what tests/test_compile.py compares every tiny compile with).
records: setup
	DFLASH_IREE_UPDATE_RECORDS=1 $(PY) -m pytest -q tests/test_compile.py -k test_record

# What a GPU run carries (bench/pack_device.py, installed there by bench/on_device.sh): the wheels,
# .gpu/wheels/ (dflash_iree built from this tree, iree-base-runtime 3.13.0 trimmed and ml_dtypes, cp312),
# and `make device-artifacts NAMES="tiny-sm_80 demo-sm_80 expected.json"`: those folders of .gpu/ in
# .gpu/artifacts.zip.
.PHONY: device-wheels device-artifacts
device-wheels: setup
	$(PY) bench/pack_device.py wheels

device-artifacts: setup
	$(PY) bench/pack_device.py artifacts $(NAMES)
