# Entry points: `make demo`, `make test` (the fast tier) and `make test-all` (everything; .ci/run).
# Each builds .venv from scratch when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Keep an existing torch (system or venv); otherwise take the pinned CPU build.
TORCH_PIN := torch==2.13.0

# The demo's job: llama-7b at seq 8192, batch 2, on 8 H100s with FSDP2 does not fit; a plan makes it fit.
DEMO_JOB := --model llama-7b --gpu h100-80gb --seq-len 8192 --batch-size 2 --precision bf16-mixed --zero 3 --dp 8
FAST := not slow and not compile and not distributed and not bench
TEST_WORKERS ?= 2  # pytest-xdist processes for the fast tier (one per core of a 2-core CI machine)

.PHONY: demo test test-all lint install bench clean

$(BIN)/memplan: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/memplan

install: $(BIN)/memplan

demo: install
	$(BIN)/memplan simulate $(DEMO_JOB) --plot demo_memory.png --json demo_memory.json
	$(BIN)/memplan plan $(DEMO_JOB) --out demo_plan.json --plot demo_memory_planned.png
	@echo
	@echo "demo_memory_planned.png: the step without and with the plan; demo_plan.json: the plan."
	@echo "Next: apply it in your training script with planner.apply_plan(model, 'demo_plan.json'),"
	@echo "  or find the cheapest layout: $(BIN)/memplan fit --model llama-7b --gpu h100-80gb --seq-len 8192 --precision bf16-mixed"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The fast tier: every module, no slow, compile, distributed or benchmark test, on TEST_WORKERS
# processes (under 3 minutes on 2 cores).
test: lint
	@start=$$(date +%s); $(BIN)/python -m pytest tests -m "$(FAST)" -n $(TEST_WORKERS); rc=$$?; \
		echo "make test: fast tier took $$(( $$(date +%s) - start )) s"; exit $$rc

test-all: lint
	$(BIN)/python -m pytest tests

bench: install
	$(BIN)/python -m benchmarks --quick --out benchmarks/results

clean:
	rm -rf $(VENV) build *.egg-info demo_memory*.png demo_memory.json demo_plan.json
