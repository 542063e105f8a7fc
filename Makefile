# The two set-up commands of the README. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# jax is pinned to the version our CPU machines support; the GPU machine brings its own.
JAX_PIN := jax==0.10.2 jaxlib==0.10.2

.PHONY: test demo lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(JAX_PIN) -e ".[dev]"
	touch $@

# -n: pytest-xdist, one worker per core (the suite is compile-bound: ~2x on the 2-core CI box).
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto

demo: $(BIN)/.installed
	$(BIN)/python -m benchmarks bert --size tiny --quick

lint: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[lint]"
	$(BIN)/ruff check dynjax tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
