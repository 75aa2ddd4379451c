"""A float checkpoint read one tensor at a time, and an empty model to read it into.

Streaming quantization (:mod:`bitmosaic.pipeline.stream`) never holds a whole model: it builds the
model's modules with their parameters on the ``meta`` device (no memory; buffers such as the rotary
frequencies are real), then fills one module at a time from the checkpoint's safetensors files,
which are memory-mapped (``safe_open``), and empties it again when done.

Sources: a Hugging Face folder (``model.safetensors`` or shards with ``model.safetensors.index.json``),
a hub id (downloaded with ``huggingface_hub.snapshot_download``, safetensors only), or a GGUF file of
any size: read tensor by tensor from the file itself
(:class:`~bitmosaic.io.sources.gguf_checkpoint.GGUFCheckpoint`), or from its converted copy
(:mod:`bitmosaic.io.sources.gguf_cache`) when an earlier load already made one (the same float32 values, read
without dequantizing).  A GGUF architecture that cannot be read tensor by tensor goes through a new
converted copy when copies are on and the file is under their size limit, else is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from ...errors import CorruptModelError, ModelSpecError, check_finite
from ...formats.mx import MXTensor, get_mx_format, mx_dequantize
from . import fp8_block
from .expert_names import ExpertSource, expert_source, fused_layouts

__all__ = ["Checkpoint", "is_file_name", "missing_tensor"]

# an unfused expert's parameter (modules/experts.py) -> the fused tensor a checkpoint may hold instead
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate|up|down)_proj\.(weight|bias)$")


def is_file_name(name) -> bool:
    """Whether ``name`` (from an index file) is a plain file name: a non-empty string with no folder part,
    not ``.`` or ``..``, so that the file it names lies in the index's own folder."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
    return plain and "\\" not in name


def missing_tensor(spec: str, name: str) -> str:
    """The one-line message of a checkpoint of model ``spec`` that lacks tensor ``name``."""
    return f"{spec}: tensor {name} is missing from the checkpoint; re-download it"


def _half_rows(rows: int, src: ExpertSource) -> slice:
    """Which of a gate/up tensor's ``rows`` output features are projection ``src.half``'s (0 gate, 1 up):
    the even or odd ones when ``interleaved`` (gpt-oss), else the first or second half."""
    n = rows // 2
    return slice(src.half, None, 2) if src.interleaved else slice(src.half * n, (src.half + 1) * n)


def _expert_slice(sl, src: ExpertSource) -> torch.Tensor:
    """Expert ``src.index`` of a fused tensor, read through the memory map: only that expert's bytes are
    copied, and where its output features are dimension 1 (not ``transposed``, or MXFP4 blocks and
    scales) only the rows of the projection ``src.half`` names (a strided read when ``interleaved``)."""
    e = slice(src.index, src.index + 1)
    full = sl.get_shape()
    if len(full) == 1 or src.half is None or src.transposed:
        return sl[e][0]  # output features last (transposed): the half is taken after the read, by _oriented
    return sl[e, _half_rows(full[1], src)][0]


def _oriented(t: torch.Tensor, src: ExpertSource) -> torch.Tensor:
    """An expert's slice (:func:`_expert_slice`, MXFP4 decoded) as the ``[out, in]`` weight of its
    projection: transposed when stored ``[in, out]``, then its gate or up rows taken; contiguous."""
    if src.transposed and t.ndim == 2:
        t = t.T
        if src.half is not None:
            t = t[_half_rows(t.shape[0], src)]
    return t.contiguous()


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 rows (``blocks`` ``[rows, G, 16]`` bytes, ``scales`` ``[rows, G]`` E8M0) as their
    exact float32 values ``[rows, 32 G]`` (:func:`bitmosaic.formats.mx.mx_dequantize`: same nibble order,
    low first, and block of 32 as the OCP MX format)."""
    rows, groups = scales.shape
    if tuple(blocks.shape) != (rows, groups, 16):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    packed = MXTensor(get_mx_format("mxfp4"), (rows, groups * 32), blocks.reshape(rows, groups * 16), scales)
    return mx_dequantize(packed, torch.float32)


class Checkpoint:
    """The tensors of a safetensors model folder, by name, read lazily."""

    def __init__(self, folder: str | Path, spec: str | None = None, fingerprint: str | None = None) -> None:
        self.folder = Path(folder)
        self.spec = spec or str(folder)
        self._fingerprint = fingerprint  # the source's, when this folder is a GGUF file's converted copy
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                msg = f"{index} is not a valid safetensors index ({e}); re-download it"
                raise CorruptModelError(msg) from None
            if not isinstance(weight_map, dict) or not all(map(is_file_name, weight_map.values())):
                raise CorruptModelError(
                    f"{index}: weight_map is not a table of tensor -> file name in this folder (a name "
                    "with a folder part or '..' may not leave it); re-download it"
                )
            self.files = {k: self.folder / v for k, v in weight_map.items()}
        elif single.is_file():
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(single), "pt") as f:
                    self.files = dict.fromkeys(f.keys(), single)
            except (SafetensorError, OSError) as e:
                raise CorruptModelError(
                    f"{single} is truncated or not a safetensors file ({' '.join(str(e).split())}); "
                    "re-download or re-save the model"
                ) from None
        else:
            raise ModelSpecError(
                f"{self.folder} holds no safetensors weights (model.safetensors or an index): streaming "
                "reads safetensors only; convert the checkpoint with save_pretrained(safe_serialization=True)"
            )
        self.fp8_block = fp8_block.block_size(self.folder)  # FP8 weights with block scales (fp8_block.py)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` (in ``dtype`` when given), checked for NaN/Inf.  The file is opened for this
        one read and the tensor is copied out of its memory map, so no page of the checkpoint stays
        mapped (and counted in the process's resident memory) after the read."""
        return self._read(name, dtype, lambda f: f.get_tensor(name), name)

    def _read(self, name: str, dtype: torch.dtype | None, pick, label: str) -> torch.Tensor:
        """``pick(f)`` of the open file that holds ``name``, copied out (in ``dtype`` when given) and
        checked for NaN/Inf (``label``: how the error names it); one line on an unreadable file."""
        from safetensors import SafetensorError, safe_open

        if name not in self.files:
            raise CorruptModelError(missing_tensor(self.spec, name))
        file = self.files[name]
        try:
            with safe_open(str(file), "pt") as f:
                t = pick(f)
                if t.dtype in fp8_block.FP8_DTYPES:
                    t = self._dequantize(name, t, dtype, label)
                else:
                    t = t.to(dtype, copy=True) if dtype is not None and t.is_floating_point() else t.clone()
        except (SafetensorError, OSError) as e:
            raise CorruptModelError(
                f"cannot read {file} ({' '.join(str(e).split())}); re-download or re-save the model"
            ) from None
        check_finite(t, f"weight {label} of model {self.spec!r}")
        return t

    def _dequantize(self, name: str, q: torch.Tensor, dtype, label: str) -> torch.Tensor:
        """An FP8 weight as the float it stands for, times its block scales (:mod:`.fp8_block`)."""
        scale_name = name + fp8_block.SCALE_SUFFIX
        if self.fp8_block is None or scale_name not in self.files:
            raise ModelSpecError(
                f"{self.spec}: tensor {label} is stored in FP8 without block scales ({scale_name} and a "
                "config quantization_config with weight_block_size); load it with transformers and save "
                "it in bf16 first"
            )
        if label != name:
            raise ModelSpecError(
                f"{self.spec}: {label} is one expert of a fused FP8 tensor, which streaming does not read "
                "in parts; quantize it without --stream"
            )
        return fp8_block.dequantize(q, self.get(scale_name), self.fp8_block, dtype, label)

    def get_part(self, src: ExpertSource, dtype: torch.dtype | None, shape) -> torch.Tensor:
        """The part of a stored tensor that :func:`~bitmosaic.io.sources.expert_names.expert_source`
        names (one expert of a fused 3-D tensor: only its rows are read; MXFP4 blocks and scales
        (gpt-oss): decoded exactly), of the given ``shape``."""
        label = f"{src.name}[{src.index}]"
        if src.index is None:
            t = self.get(src.name, dtype)
        elif src.scales is None:  # one expert of a fused 3-D tensor: only its rows are read
            pick = lambda f: _oriented(_expert_slice(f.get_slice(src.name), src), src)  # noqa: E731
            t = self._read(src.name, dtype, pick, label)
        else:  # MXFP4 blocks and scales (gpt-oss): the expert's rows of both, decoded exactly
            read_scales = lambda f: _expert_slice(f.get_slice(src.scales), src)  # noqa: E731
            scales = self._read(src.scales, None, read_scales, label)

            def pick(f):
                return _oriented(_mxfp4(_expert_slice(f.get_slice(src.name), src), scales), src)

            try:
                t = self._read(src.name, dtype, pick, label)
            except ValueError as e:
                raise CorruptModelError(f"{self.spec}: {label}: {e}; re-download the model") from None
        if tuple(t.shape) != tuple(shape):
            raise CorruptModelError(
                f"{self.spec}: tensor {src.name} gives a part of shape {tuple(t.shape)} where the model's "
                f"config needs {tuple(shape)}; the checkpoint does not match its config.json"
            )
        return t

    def fingerprint(self) -> str:
        """What identifies the checkpoint cheaply: its config and every file's name, size and mtime (a
        GGUF file's converted copy: the GGUF file's, so a resumed run may read either)."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.sha256((self.folder / "config.json").read_bytes())
        for f in sorted(set(self.files.values())):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()[:24]

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder)

    def empty_model(self, dtype: torch.dtype) -> nn.Module:
        """The model's modules in ``dtype`` with parameters on ``meta`` (buffers real), in eval mode."""
        from accelerate import init_empty_weights

        from .model_class import auto_model_class

        config = self.config()
        try:
            with init_empty_weights(include_buffers=False):
                model = auto_model_class(config).from_config(config, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a config transformers reads but cannot build (zero heads, ...)
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            raise CorruptModelError(
                f"the config of {self.spec!r} describes no model transformers can build "
                f"({type(e).__name__}: {reason}); re-download it"
            ) from None
        self._layouts = fused_layouts(model)  # before unfusing: how its fused experts lie (gpt-oss)
        return model.eval()

    def fused_layouts(self) -> dict:
        """The model's fused-experts layouts by module name (:func:`.expert_names.fused_layouts`), from
        the empty model (built here, on ``meta``, when :meth:`empty_model` has not run)."""
        if getattr(self, "_layouts", None) is None:
            self.empty_model(torch.float32)
        return self._layouts

    def _expert_source(self, key: str) -> ExpertSource | None:
        """Where the checkpoint holds expert tensor ``key`` under another name or fused (expert_names.py)."""
        return expert_source(key, self.files, self.fused_layouts() if _EXPERT.match(key) else None)

    def _refuse_fused(self, key: str) -> None:
        """A missing expert projection whose layer the checkpoint stores fused in a layout
        :func:`.expert_names.expert_source` does not read (say MXFP4 blocks without their scales): one
        line saying so (the in-memory load converts what transformers converts)."""
        m = _EXPERT.match(key)
        if m is None:
            return
        fused = [f"{m.group(1)}.{p}{s}" for p in ("gate_up_proj", "down_proj") for s in ("", "_blocks")]
        if any(f in self for f in fused):
            raise ModelSpecError(
                f"{self.spec} stores its experts fused ({next(f for f in fused if f in self)}) in a layout "
                "streaming does not read one expert at a time; quantize it without --stream"
            )

    def fill(self, module: nn.Module, prefix: str, dtype: torch.dtype, skip=()) -> None:
        """Read ``module``'s parameters (and persistent buffers) named ``prefix + name`` into it, less
        those of the submodules named in ``skip`` (left as they are)."""
        sd = {}
        skip = tuple(s + "." for s in skip)
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if skip and name.startswith(skip):
                continue
            key = prefix + name
            want = dtype if t.is_floating_point() else None
            if key in self:
                sd[name] = self.get(key, want)
            elif (src := self._expert_source(key)) is not None:  # a MoE tensor stored otherwise
                sd[name] = self.get_part(src, want, t.shape)
            elif t.device.type == "meta":
                self._refuse_fused(key)
                raise CorruptModelError(missing_tensor(self.spec, key))
        module.load_state_dict(sd, strict=False, assign=True)
