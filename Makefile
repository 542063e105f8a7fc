# The two set-up commands of the README. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# jax is pinned to the version our CPU machines support.  On a machine with an NVIDIA GPU
# (nvidia-smi lists one) set-up installs the CUDA build of the same jax and the demo runs the
# GPU table; DYNJAX_DEVICE=cpu forces the CPU set-up and demo.
JAX_VERSION := 0.10.2
DYNJAX_DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
ifeq ($(DYNJAX_DEVICE),gpu)
JAX_PIN := "jax[cuda12]==$(JAX_VERSION)" "jaxlib==$(JAX_VERSION)"
DEMO_ARGS := --size base --requests 400 --jit_budget_s 30 --oracle_max_shapes 16 \
	--modes jit,oracle,pad_max,dynjax_pow2,dynjax_serve,dynjax_serve_auto,dynjax_restart,torch_eager
else
JAX_PIN := "jax==$(JAX_VERSION)" "jaxlib==$(JAX_VERSION)"
DEMO_ARGS := --size tiny --quick
endif

.PHONY: test test-slow test-all demo lint clean

# --no-compile: pip byte-compiles every installed module (~14 s of a 28 s install on the 2-core
# CI box); Python compiles the ~few hundred the suite imports on first use (~0.4 s).
$(BIN)/.installed-$(DYNJAX_DEVICE): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile $(JAX_PIN) -e ".[dev]"
	rm -f $(BIN)/.installed-*
	touch $@

# -n: pytest-xdist, one worker per core (the suite is compile-bound: ~2x on the 2-core CI box);
# worksteal: an idle worker takes queued tests from the busy one.  `make test` runs the tests
# not marked slow (tests/_slow.py lists the ones measured at >= 1.5 s each: 128 of 877 tests,
# ~70% of the suite's time); `make test-slow` runs those, `make test-all` everything in one run.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist worksteal

test: $(BIN)/.installed-$(DYNJAX_DEVICE)
	$(PYTEST) -m "not slow"

test-slow: $(BIN)/.installed-$(DYNJAX_DEVICE)
	$(PYTEST) -m slow

test-all: $(BIN)/.installed-$(DYNJAX_DEVICE)
	$(PYTEST)

# The main job: BERT served with dynjax against jax.jit, padding to the max and (when torch is
# installed) PyTorch; on a GPU the BERT-base table, on a CPU a small one (~80 s on 2 cores).
demo: $(BIN)/.installed-$(DYNJAX_DEVICE)
	$(BIN)/python -m benchmarks bert $(DEMO_ARGS)

lint: $(BIN)/.installed-$(DYNJAX_DEVICE)
	$(BIN)/python -m pip install -q -e ".[lint]"
	$(BIN)/ruff check dynjax tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
