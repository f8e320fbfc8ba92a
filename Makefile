# Two entry points: `make demo` and `make test`. Both build .venv from scratch when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Keep an existing torch (system or venv); otherwise take the pinned CPU build.
TORCH_PIN := torch==2.13.0

.PHONY: demo test install bench clean

$(BIN)/memplan: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/memplan

install: $(BIN)/memplan

demo: install
	$(BIN)/memplan simulate --model llama-7b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed \
		--plot demo_memory.png --json demo_memory.json

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests

bench: install
	$(BIN)/python -m benchmarks --quick --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info
