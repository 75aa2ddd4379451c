# bitmosaic: `make demo` quantizes SmolLM2-135M (GPTQ w4 g128) and prints perplexities;
# `make test` installs and runs the test-suite.
PYTHON ?= python3
SHARED_DATA := $(wildcard $(abspath ../shared/data))
ifneq ($(SHARED_DATA),)
export BITMOSAIC_DATA ?= $(SHARED_DATA)
endif

.PHONY: install demo test test-fast lint bench

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

demo: install
	$(PYTHON) -m bitmosaic.cli quantize --model smollm2-135m --method gptq --bits 4 --group-size 128 \
	  --nsamples 32 --seqlen 512 --eval wikitext2 --eval-float --max-windows 40 \
	  --out runs/smollm2-gptq-w4g128 --json runs/smollm2-gptq-w4g128.json

test: install
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m "not model"

lint:
	$(PYTHON) -m ruff check src tests benchmarks

bench: install
	$(PYTHON) benchmarks/orders.py
