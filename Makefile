# bitmosaic: `make demo` quantizes SmolLM2-135M (GPTQ w4 g128) and prints perplexities;
# `make test` installs and runs the test-suite.  Both install into the project's virtual environment
# .venv (created on first use; `source .venv/bin/activate` afterwards); `make PYTHON=python3 test`
# uses another interpreter as it is.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
SHARED_DATA := $(wildcard $(abspath ../shared/data))
ifneq ($(SHARED_DATA),)
export BITMOSAIC_DATA ?= $(SHARED_DATA)
endif

.PHONY: install demo test test-fast lint bench compare

install:
	VENV=$(VENV) PYTHON=$(PYTHON) bash scripts/install.sh

demo: install
	$(PYTHON) -m bitmosaic.cli quantize --model smollm2-135m --method gptq --bits 4 --group-size 128 \
	  --nsamples 32 --seqlen 512 --eval wikitext2 --eval-float --max-windows 40 \
	  --out runs/smollm2-gptq-w4g128 --json runs/smollm2-gptq-w4g128.json

test: install
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m "not model"

lint: install
	$(PYTHON) -m ruff check src tests benchmarks scripts

bench: install
	$(PYTHON) -m benchmarks.gptq.orders

# Every method at 2-8 bits on SmolLM2-135M: table, Pareto plot and report in runs/compare-smollm2
# (resumable; about an hour on 2 cores). Its last results are in benchmarks/results/compare_smollm2.*.
COMPARE_CONFIGS := rtn:w2g64, rtn:w3g128, rtn:w4g128, rtn:w8g128, gptq:w2g64, gptq:w3g128, gptq:w4g128, \
  babai:w3g128, awq:w2g64, awq:w3g128, awq:w4g128, hptq:;target-bits=3.125, hrtn:;target-bits=3.125, \
  ssqr:w3g128, sfmp:bpw2.5, sfmp:bpw3.25, sfmp:bpw4.25, fp8:, smoothquant:w8a8, dpq:w4a8-fp8, \
  sq-weights:;sq=32-(8/4)-0.75, sq-acts:w4;sq=16-(8/4)-0.5;strategy=static, mosaic:w4a8, mosaic:w4a4
compare: install
	$(PYTHON) -m bitmosaic.cli compare --model smollm2-135m --out runs/compare-smollm2 --nsamples 16 \
	  --max-windows 10 --configs "$(COMPARE_CONFIGS)"
