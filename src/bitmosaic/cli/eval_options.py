"""What ``bitmosaic eval`` resolves before and after loading: the float reference of ``--fidelity``
``--runtime-act`` (run-time INT8 activations, :mod:`bitmosaic.modules.intact`) and ``--runtime-head``
(the 8-bit output head, :mod:`bitmosaic.modules.head`)."""

from __future__ import annotations

from pathlib import Path


def is_saved_quantized(model: str) -> bool:
    import json

    cfg = Path(model) / "config.json"
    try:
        qc = json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config") if cfg.is_file() else None
    except (OSError, ValueError, AttributeError):
        return True  # a damaged folder: let the loader name what is wrong with it
    return isinstance(qc, dict) and qc.get("quant_method") == "bitmosaic"


def add_runtime_act_argument(parser) -> None:
    """``--runtime-act`` (``eval`` and ``generate``): the weight-only layers' run-time integer activations."""
    parser.add_argument(
        "--runtime-act", choices=("none", "int8", "q8_0", "int16"), default=None,
        help="int8: weight-only layers quantize their inputs to 8 bits per token at run time and multiply "
        "in integers; q8_0: the same with one scale per block of 32 channels, as llama.cpp does; int16: 16 "
        "bits per token, multiplied as two int8 halves (within the verdict protocol's noise of weight-only); "
        "not saved; default $BITMOSAIC_RUNTIME_ACT, else int16 where the integer kernel runs AVX-512 VNNI, "
        "else none",
    )  # fmt: skip


def apply_runtime_act(model, mode: str) -> None:
    """``eval --runtime-act MODE`` on a loaded model (modules/intact.py), with one line saying what runs."""
    from ..modules.intact import set_runtime_activations

    n = set_runtime_activations(model, mode)
    if mode != "none":
        per = "per block of 32 channels" if mode == "q8_0" else "per token"
        print(f"runtime activations {mode}: {n} weight-only layers quantize inputs {per} (not saved)")


def announce_runtime_act(model) -> None:
    """One line when a loaded model runs run-time activations it was not asked for (the load default)."""
    from ..modules.intact import RUNTIME_ACT_ENV, runtime_act_chosen, runtime_activations

    mode = runtime_activations(model)
    if mode != "none":
        why = f"${RUNTIME_ACT_ENV}" if runtime_act_chosen() else "the default at load on this CPU"
        print(f"runtime activations {mode} ({why}; --runtime-act none: weight-only)")


def apply_runtime_head(model, mode: str) -> None:
    """``eval --runtime-head MODE`` on a loaded model (modules/head.py), with one line saying what runs."""
    from ..modules.head import set_runtime_head

    if set_runtime_head(model, mode):
        acts = ", its inputs quantized to int8 per block too" if mode == "q8_0" else ""
        print(f"runtime head {mode}: the output head runs an 8-bit copy (blocks of 32{acts}; not saved)")
    elif mode != "none":
        print(f"runtime head {mode}: this model has no linear output head; it stays as it is")


def fidelity_reference(model: str, ref: str) -> str:
    """The float model ``eval --fidelity`` compares with: REF, or a saved folder's source model."""
    if ref != "source":
        return ref
    from ..errors import BitmosaicError, OptionError
    from ..io.saved.load import verify_saved

    if not (Path(model) / "config.json").is_file():
        raise OptionError(f"--fidelity needs the float model to compare {model} with: give --fidelity MODEL")
    try:
        _, qc = verify_saved(Path(model))
    except BitmosaicError as e:
        raise OptionError(f"--fidelity without MODEL reads {model}'s provenance: {e}") from None
    src = qc.get("source_model") or (qc.get("provenance") or {}).get("model")
    if not src:
        raise OptionError(f"{model} does not record the model it was quantized from: give --fidelity MODEL")
    return str(src)
