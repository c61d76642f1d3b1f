# Two commands do everything on a fresh Linux machine with Python 3.10+:
#   make demo   install if needed, then train DiffNet on Burgers with mpiexec -n 2
#   make test   install if needed, then the everyday test suite (the rest: make test-full; the
#               bench harness's runs: make test-bench)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# The CPU build of torch only: "+cpu" never matches PyPI's CUDA build, so a missing wheel
# fails loudly instead of downloading several GB. Local wheels (pip's find-links) come first,
# then the PyTorch CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Set USE_SITE_MPI=1 to build mpi4py against the cluster's MPI instead of the PyPI runtime.
USE_SITE_MPI ?= 0
# One stamp per MPI choice, so switching USE_SITE_MPI re-installs instead of keeping the other MPI.
STAMP  := $(VENV)/.installed-mpi$(USE_SITE_MPI)
NP     ?= 2
# Test processes (pytest-xdist; one test file per process, so a file's fixtures are built once).
# 2 fits CI's 2 cores: single-rank tests and process start-ups leave the other core idle
# (8 min 10 s against 9 min 19 s in one process here). TEST_JOBS=0: one process, test by test.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -q tests -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

.PHONY: install demo test test-full test-fast test-bench test-lab test-slurm bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$(TORCH_VERSION)' else 1)" 2>/dev/null \
	  || $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
	  || $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX)
ifeq ($(USE_SITE_MPI),1)
	-@$(PIP) uninstall -y -q mpich 2>/dev/null
	$(PIP) install -q --force-reinstall --no-deps --no-binary mpi4py mpi4py
	$(PIP) install -q -e ".[test]"
else
	$(PIP) install -q -e ".[mpi,test]"
endif
	@$(PY) -c "import torch, mpi4py, h5py, scipy; print('installed: torch', torch.__version__, '| mpi4py', mpi4py.__version__)"
	@rm -f $(VENV)/.installed-mpi*
	@touch $(STAMP)

demo: install
	$(VENV)/bin/deepfusion demo --np $(NP)

# The suite starts hundreds of Python processes (ranks, CLI runs); where PYTHONDONTWRITEBYTECODE is set
# (as on CI here) each would compile our modules again, ~0.1 s of its ~2.3 s start-up (most of
# the rest is importing torch). compileall writes the bytecode once, whatever that variable says.
BYTECODE := $(PY) -m compileall -q deepfusion diffnet bench tests lab > /dev/null

# The ONNX export tests need the onnx extra: installed if missing, else they skip and say why.
ONNX_EXTRA := $(PY) -c "import onnx, onnxruntime, onnxscript" 2>/dev/null || $(PIP) install -q -e ".[onnx]" || echo "note: the onnx extra did not install here: the ONNX export tests are skipped"

# `make test` is the everyday suite: every subsystem once with real MPI (its budget: 8 minutes
# on 2 cores). `make test-full` runs what it leaves out (marker `full`: other rank counts, layouts,
# recipes, faults and the longer docs examples); CI runs both. The benchmark harness's
# end-to-end runs (marker `bench`: bench/ at tiny sizes, several processes each) are `make
# test-bench`, in neither: they check the measuring tools behind `make bench`, not the product;
# the harness's pure functions stay in `make test`.
test: install
	@$(ONNX_EXTRA)
	@$(BYTECODE)
	$(PYTEST) -m "not bench and not full"

test-full: install
	@$(ONNX_EXTRA)
	@$(BYTECODE)
	$(PYTEST) -m full

test-bench: install
	@$(BYTECODE)
	$(PYTEST) -m bench

# The research record's tools (lab/tools) at tiny sizes; not part of `make test`.
test-lab: install
	@$(BYTECODE)
	$(PY) -m pytest -q lab/tests -n $(TEST_JOBS) --dist loadfile

test-fast: install
	@$(BYTECODE)
	$(PYTEST) -m "not mpi and not slow and not bench and not full"

# The job scripts under a real Slurm: as root with apt-get (or beside a running cluster) it installs
# slurm-wlm + munge if missing, starts a one-node cluster on localhost in a temporary directory,
# runs tests/test_slurm*.py and stops every daemon it started; elsewhere it prints why and skips.
test-slurm: install
	$(PY) -m tests.slurm_local test

bench: install
	$(PY) -m bench.run --out bench/out

clean:
	rm -rf $(VENV) *.egg-info build
