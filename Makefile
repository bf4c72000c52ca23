# Two entry points: `make run` (set up, then train the default) and `make test` (set up, then test).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-all clean gpu-bundle

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, from the constraints file, so nothing pulls a CUDA build.
	$(BIN)/python -m pip install -q -c constraints/cpu.txt torch triton
	$(BIN)/python -m pip install -q -c constraints/cpu.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m platform.run $(ARGS)

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(ARGS)

# An offline GPU host in one command: wheels it lacks (.whl/) and pre-tokenized shards (.shards/),
# both git-ignored; then there: `bash benchmarks/gpu_check.sh` (docs/gpu.md).
gpu-bundle: setup
	$(BIN)/python -m benchmarks.gpu_bundle

clean:
	rm -rf $(VENV)
