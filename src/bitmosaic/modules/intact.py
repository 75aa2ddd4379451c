"""Integer activation compute: which layers run ``Q(x) Wᵀ`` in integers, and the kernel weight that does it.

A quantized module with an INT activation quantizer (``input_quant``, :mod:`.actquant`) runs its
forward in one of two ways:

* **integer** (the default where it can): the input is *not* fake-quantized by the pre-hook; the
  module's :class:`IntActKernel` quantizes it to int8 with the quantizer's own scales
  (:func:`bitmosaic.formats.act.act_scales`) and multiplies the integers
  (:class:`bitmosaic.kernels.intmm.IntActWeight`: AVX-512 VNNI / AVX2 / portable, int32 sums per weight
  group).  Same integers as the simulated path; outputs equal up to float32 rounding.
* **simulated**: the pre-hook replaces the input by ``Q(x) = q s`` in float and the weight-only
  kernel multiplies it in float32.  Always the case for FP8/FP4 activations (DPQ's FP8 compute: this CPU
  has no FP8 instruction), for kinds without an integer path (``INT_ACT_KERNELS`` empty: SSQR's CSR
  outliers, DPQ, SFMP, Huffman, FP8 weights; MosaicQuant and the SQ-format activations have their own,
  ``kernels/mosaic.py`` and ``modules/sq.py``, with their own blockers), for group sizes
  that are not multiples of 8, activation groups that neither hold whole weight groups nor split them
  into multiples of 8 (:func:`act_weight_groups`), off the CPU,
  and under ``$BITMOSAIC_ACT_COMPUTE=sim`` (for comparison).

:func:`int_act_blocker` says which, and why; ``bitmosaic inspect --layers`` prints it per layer.

**Runtime 8-bit activations for weight-only models** (:func:`set_runtime_activations`, ``bitmosaic eval
--runtime-act int8``, ``$BITMOSAIC_RUNTIME_ACT``): what llama.cpp does with every quantized matmul -- the
input quantized to 8 bits (dynamic, symmetric) and multiplied in integers: ``int8`` with one scale per
token, ``q8_0`` with one scale per block of 32 channels of each token, as llama.cpp's ``Q8_0`` activations
(the weight's groups split into blocks of 32 for the kernel, :func:`act_weight_groups`; an act-order
layer's blocks are of its stored, permuted columns); ``int16`` with one scale per token and 16-bit
integers (``|q| <= 127·256 + 127``), which the kernel multiplies as two int8 halves in one pass over the
weight (:mod:`bitmosaic.kernels.intmm`): 256 times finer steps than ``int8``.  A weight-only layer then
runs the integer kernel with a quantizer that is *not* part of the model (not saved, not in the state
dict, not in the config): an approximation chosen at run time for speed
(``benchmarks/waq/int_ppl.py`` measures its KL and top-1 agreement against the weight-only path,
``benchmarks/decode/decode.py`` the speed).  ``int16`` is within the verdict protocol's noise of
weight-only (perplexity +0.0005%, paired 95% interval [-0.0004%, +0.0014%],
``benchmarks/results/int_ppl_a16_verdict.md``) and faster where the kernel runs AVX-512 VNNI, so every
load path applies it there by default, to layers with codes of 4 bits or more (below, the bit-plane LUT
with float activations is as fast or faster: ``benchmarks/results/int16_widths.md``;
:func:`default_runtime_activations`; ``$BITMOSAIC_RUNTIME_ACT=none`` or ``--runtime-act none`` keeps the
layers weight-only, ``$BITMOSAIC_RUNTIME_ACT=int16`` gives it to every width); ``int8`` and ``q8_0``
are not within noise (+0.30% for ``q8_0``) and stay opt-in (docs/cpu-inference.md).
It applies only where the integer path runs (the layer's kernel, group size, the CPU); elsewhere, and under
``$BITMOSAIC_ACT_COMPUTE=sim``, the layer stays weight-only (there is nothing to gain from simulating it).
"""

from __future__ import annotations

import math
import os

import torch

from ..formats.act import ActQuantSpec, act_scales
from ..kernels.intmm import MAX_K, IntActWeight, vnni
from ..kernels.isa import kernel_isa
from ..kernels.select import KERNELS, runs

__all__ = [
    "ACT_COMPUTE_ENV",
    "RUNTIME_ACT_ENV",
    "RUNTIME_ACT_SPECS",
    "act_compute_mode",
    "act_weight_groups",
    "int_act_blocker",
    "IntActKernel",
    "act_path_label",
    "runtime_act_mode",
    "runtime_activations",
    "DEFAULT_RUNTIME_ACT",
    "DEFAULT_RUNTIME_MIN_BITS",
    "default_runtime_act",
    "default_runtime_activations",
    "default_runtime_act_for",
    "runtime_act_chosen",
    "segmented_int_weight",
    "set_runtime_activations",
]

ACT_COMPUTE_ENV = "BITMOSAIC_ACT_COMPUTE"
_MODES = ("auto", "sim")
RUNTIME_ACT_ENV = "BITMOSAIC_RUNTIME_ACT"
# --runtime-act choice -> the activation quantizer weight-only layers get at run time (None: stay weight-only)
# int8: one scale per token; q8_0: one per block of 32 channels per token (llama.cpp's Q8_0 activations)
RUNTIME_ACT_SPECS: dict[str, ActQuantSpec | None] = {
    "none": None,
    "int8": ActQuantSpec("int", 8),
    "q8_0": ActQuantSpec("int", 8, granularity="group", group_size=32),
    # int16: one scale per token, 16-bit integers run as two int8 halves (kernels/intmm.py)
    "int16": ActQuantSpec("int", 16),
}


def act_compute_mode() -> str:
    """``$BITMOSAIC_ACT_COMPUTE``: ``auto`` (unset: integer wherever it runs) or ``sim`` (simulated)."""
    mode = os.environ.get(ACT_COMPUTE_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"${ACT_COMPUTE_ENV}={mode!r} is not one of {', '.join(_MODES)}; unset it or pick one"
        )
    return mode


def runtime_choice(mode: str | None, env: str, flag: str, choices) -> str:
    """A run-time switch's value: ``mode``, or ``$env`` when ``mode`` is ``None`` (unset: ``none``),
    lower-cased; one not in ``choices`` raises :class:`~bitmosaic.errors.OptionError` naming ``flag`` (or
    the variable) and the choices."""
    from ..errors import OptionError

    source = f"${env}" if mode is None else flag
    value = os.environ.get(env, "none") if mode is None else mode
    value = value.strip().lower() or "none"
    if value not in choices:
        raise OptionError(f"{source}={value!r} is not one of {', '.join(choices)}")
    return value


def runtime_act_mode(mode: str | None = None) -> str:
    """``mode`` (``none``/``int8``/``q8_0``/``int16``), or ``$BITMOSAIC_RUNTIME_ACT`` when ``mode`` is
    ``None`` (unset: ``none``); anything else raises :class:`~bitmosaic.errors.OptionError` naming the
    choices."""
    return runtime_choice(mode, RUNTIME_ACT_ENV, "--runtime-act", RUNTIME_ACT_SPECS)


# what a load path gives the weight-only layers when $BITMOSAIC_RUNTIME_ACT is unset (issue 74: within the
# verdict protocol's noise of weight-only, benchmarks/results/int_ppl_a16_verdict.md), on the CPUs it was
# measured faster on (AVX-512 VNNI: benchmarks/results/int_gemm_int16.md, decode_a16_r3.md)
DEFAULT_RUNTIME_ACT = "int16"
# ... on layers of code widths from 4 bits: below, the float-activation kernel (the bit-plane LUT) is as
# fast or faster at decode (benchmarks/results/int16_widths.md)
DEFAULT_RUNTIME_MIN_BITS = 4


def runtime_act_chosen() -> bool:
    """Whether ``$BITMOSAIC_RUNTIME_ACT`` chooses the run-time activations (set and not empty)."""
    return bool(os.environ.get(RUNTIME_ACT_ENV, "").strip())


def default_runtime_act() -> str:
    """The run-time activation mode a load path applies: ``$BITMOSAIC_RUNTIME_ACT`` when set (a bad value
    raises :class:`~bitmosaic.errors.OptionError`), else :data:`DEFAULT_RUNTIME_ACT` where the integer
    kernel runs AVX-512 VNNI (the measured machines) and ``$BITMOSAIC_ACT_COMPUTE`` is not ``sim``, else
    ``none``."""
    if runtime_act_chosen():
        return runtime_act_mode()
    if act_compute_mode() == "sim" or kernel_isa() != "avx512" or not vnni():
        return "none"
    return DEFAULT_RUNTIME_ACT


def default_runtime_activations(model: torch.nn.Module) -> str:
    """What every bitmosaic load path does (``bitmosaic.load``, ``from_pretrained`` of a bitmosaic folder,
    ``bitmosaic eval``/``generate`` of one): :func:`set_runtime_activations` with
    :func:`default_runtime_act` when ``$BITMOSAIC_RUNTIME_ACT`` is set (on every weight-only layer), else
    :data:`DEFAULT_RUNTIME_ACT` on the layers with codes of :data:`DEFAULT_RUNTIME_MIN_BITS` bits or more
    (where the default is not ``none``; a model where no layer then runs it stays as it was).  Returns
    the mode now on."""
    mode = default_runtime_act()
    if mode == "none":
        return mode
    if runtime_act_chosen():
        set_runtime_activations(model, mode)
    elif not set_runtime_activations(model, mode, min_bits=DEFAULT_RUNTIME_MIN_BITS):
        set_runtime_activations(model, "none")  # nothing wide enough runs it (a W2 model): as loaded
        return "none"
    return mode


def default_runtime_act_for(bits: int | None) -> str:
    """The run-time activation mode a load path gives a weight-only layer with codes of ``bits`` bits
    (:func:`default_runtime_activations`; ``bitmosaic inspect`` says it per layer)."""
    wide = (bits or 0) >= DEFAULT_RUNTIME_MIN_BITS
    return default_runtime_act() if runtime_act_chosen() or wide else "none"


def runtime_activations(model: torch.nn.Module) -> str:
    """The run-time activation mode last set on ``model`` (:func:`set_runtime_activations`), ``none``
    when never set."""
    return model.__dict__.get("bitmosaic_runtime_act", "none")


def set_runtime_activations(
    model: torch.nn.Module, mode: str | None = None, min_bits: int | None = None
) -> int:
    """Give every weight-only quantized layer of ``model`` the run-time activation quantizer of ``mode``
    (module doc; ``None``: ``$BITMOSAIC_RUNTIME_ACT``), or take it away (``"none"``); ``min_bits``: only
    the layers whose codes are that wide or wider (the others stay weight-only).  Layers with an
    activation quantizer of their own keep it.  Returns how many layers will run it (those the integer
    path runs on this machine)."""
    from .actquant import ActQuantizer
    from .changes import mark_changed

    mode = runtime_act_mode(mode)
    spec = RUNTIME_ACT_SPECS[mode]
    mark_changed(model)
    model.__dict__["bitmosaic_runtime_act"] = mode  # what runtime_activations(model) reports
    n = 0
    for m in model.modules():
        # a quantized module (modules/base.py QuantModule, named by what it has: base imports this file)
        if not callable(getattr(m, "act_quantizer", None)) or m._modules.get("input_quant") is not None:
            continue
        narrow = min_bits is not None and (_code_bits(m) or 0) < min_bits
        m.__dict__["_runtime_act"] = None if spec is None or narrow else ActQuantizer(spec, m.in_features)
        m._drop_int_act()  # rebuilt for (or without) the new quantizer on the next forward
        if m.__dict__["_runtime_act"] is not None and m.int_act_blocker() is None:
            n += 1
    return n


def _code_bits(m: torch.nn.Module) -> int | None:
    """A quantized layer's code width (``storage_bits``, else ``bits``), ``None`` when it has neither."""
    bits = getattr(m, "storage_bits", None) or getattr(m, "bits", None)
    return int(bits) if isinstance(bits, int) else None


def int_act_blocker(
    kernels: tuple[str, ...],
    spec: ActQuantSpec | None,
    bits: int,
    group_size: int,
    in_features: int,
    permuted: bool,
) -> str | None:
    """``None`` when a layer (its kind's ``INT_ACT_KERNELS``, activation ``spec``, weight code width
    ``bits``, ``group_size``, ``in_features``, act-order ``permuted`` columns) runs the integer path on
    this machine, else why not (a short phrase)."""
    if spec is None:
        return "no activation quantizer"
    if spec.fmt != "int":
        return f"{spec.fmt} activations: no CPU instruction"
    if not kernels:
        return "no integer path for this kind"
    kernel = KERNELS[kernels[0]]
    gs = in_features if group_size is None or group_size < 0 or group_size >= in_features else group_size
    per_row = gs >= in_features
    if not runs(kernel, bits, "cpu", None if per_row else gs):
        return f"group size {gs} is not a multiple of {kernel.SUPPORTS_GROUP_SIZE_MULTIPLE}"
    if in_features >= MAX_K:
        return f"{in_features} input columns (the int32 sums hold fewer than {MAX_K})"
    if spec.granularity == "group" and spec.group_size < in_features:
        ag = spec.group_size
        if permuted:
            return "act-order columns with per-group activation scales"
        holds = not per_row and ag % gs == 0
        splits = (per_row or gs % ag == 0) and ag % kernel.SUPPORTS_GROUP_SIZE_MULTIPLE == 0
        if not (holds or splits):
            return (
                f"activation groups of {ag} neither hold whole weight groups of {gs} nor split them "
                f"into groups of a multiple of {kernel.SUPPORTS_GROUP_SIZE_MULTIPLE}"
            )
    return None


def act_weight_groups(
    scales: torch.Tensor, zeros, group_size: int | None, in_features: int, spec: ActQuantSpec
) -> tuple[torch.Tensor, torch.Tensor | float, int]:
    """The weight's ``scales [N, G]`` / ``zeros`` (a number or ``[N, G]``) and group size as the integer
    kernel takes them for activation ``spec``: unchanged, unless the activation groups are finer than the
    weight groups (a per-row or g128 weight with activations in groups of 32 or 64, llama.cpp's ``Q8_0``
    blocks, W4A4 per group) -- then each weight group is split into the activation's groups, its
    scale and zero repeated, so every int32 sum covers one activation group and one weight group
    (same integers, same products; only more epilogues).  Call after :func:`int_act_blocker` said
    ``None``."""
    K = in_features
    gs = K if group_size is None or group_size < 0 or group_size >= K else int(group_size)
    if spec.granularity != "group" or spec.group_size >= gs:
        return scales, zeros, gs
    ag, Ga = spec.group_size, -(-K // spec.group_size)
    reps = Ga if gs >= K else gs // ag

    def split(t):
        return t.repeat_interleave(reps, dim=1)[:, :Ga] if torch.is_tensor(t) else t

    return split(scales), split(zeros), ag


def act_path_label(blocker: str | None, spec: ActQuantSpec | None) -> str:
    """What ``inspect`` prints for a layer: ``int8 (avx512-vnni)``, ``simulated (<why>)``, ``weight-only``."""
    if spec is None:
        return "weight-only"
    if blocker is not None:
        return f"simulated ({blocker})"
    if act_compute_mode() == "sim":
        return f"simulated (${ACT_COMPUTE_ENV}=sim)"
    if not IntActWeight.compiled():
        return f"int{spec.bits} (torch._int_mm)"
    isa = kernel_isa()
    isa = "avx512-vnni" if isa == "avx512" and vnni() else isa
    return f"int{spec.bits} ({isa})"


def _scale_table(s: torch.Tensor, spec: ActQuantSpec) -> torch.Tensor:
    """:func:`act_scales`' result as ``[1 or M, Ga]`` (what the kernel takes)."""
    if spec.granularity == "tensor" or (spec.static and spec.granularity == "group"):
        return s.reshape(1, -1)
    return s.reshape(-1, s.shape[-1])


class IntActKernel:
    """``x -> Q(x) Wᵀ`` in integers for one layer: an :class:`IntActWeight` and the act-order
    permutation of its columns (``None``: natural order).  ``stored_order``: activation groups are
    taken over the permuted (stored) columns -- the run-time ``q8_0`` blocks of an act-order layer,
    which have no simulated counterpart to match; a layer's own per-group quantizer is defined over
    the model's channel order, so with act-order it runs simulated (:func:`int_act_blocker`)."""

    def __init__(self, weight: IntActWeight, perm: torch.Tensor | None = None, stored_order=False) -> None:
        self.weight = weight
        self.perm = perm
        self.stored_order = stored_order

    def __call__(self, x: torch.Tensor, quantizer) -> torch.Tensor:
        spec, K = quantizer.spec, self.weight.K
        x2 = x.reshape(-1, K).float()
        if self.perm is not None and self.stored_order:
            x2 = x2.index_select(-1, self.perm)
        s = None  # dynamic per token or group: the kernel computes scale_from_amax itself (same float32 ops)
        if spec.granularity == "tensor" or spec.static or spec.pow2 or spec.clip_ratio != 1:
            s = _scale_table(act_scales(x2, spec, quantizer.scale), spec)  # the simulated path's scales
        if self.perm is not None and not self.stored_order:  # per-token/-tensor scales: any column order
            x2 = x2.index_select(-1, self.perm)
        group = spec.group_size if spec.granularity == "group" else K
        y = self.weight.matmul(x2, s, group, spec.qmax)
        return y.reshape(*x.shape[:-1], self.weight.N).to(x.dtype)

    def nbytes(self) -> int:
        perm = 0 if self.perm is None else self.perm.numel() * self.perm.element_size()
        return self.weight.nbytes() + perm


def segmented_int_weight(
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros,
    g_idx: torch.Tensor,
    cols: torch.Tensor,
    act_ids: torch.Tensor,
) -> tuple[IntActWeight, torch.Tensor, int] | str:
    """An :class:`IntActWeight` over the columns ``cols`` of ``codes [N, K]`` (in that order) for
    activations that come in parts with their own scales (the SQ-format's high and low channels), so
    each int32 sum has one weight scale and one activation scale -- or why not (a phrase).  ``g_idx``:
    the weight group of each column (scales ``[N, Gw]``, zeros a number or ``[N, Gw]``); ``act_ids``:
    the activation scale column of each selected column.

    Returns ``(weight, scale column of each run, run)``.  Where the activation scale changes inside
    the runs of one weight group (per-bank scales: runs of 8 in groups of 64), the weight keeps those
    runs as its groups (the runs' greatest common length) and ``run`` is the activation runs' common
    length (a multiple of 8 dividing it), for :meth:`IntActWeight.product_runs`: ``runs per group``
    scale columns per group, the last group's unused ones repeating its last.  Otherwise ``run`` is 0
    and the groups are the pieces of the runs of one weight group and one activation scale, one scale
    column each (:meth:`IntActWeight.product`); that length must be a multiple of 8 unless there is
    one piece."""
    if not cols.numel():
        return "no columns"
    wg, ag = g_idx.long()[cols], act_ids.long()
    n = cols.numel()

    def lengths_of(differs: torch.Tensor) -> torch.Tensor:  # the runs' lengths (a new run where differs)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), differs.nonzero().reshape(-1) + 1])
        return torch.diff(starts, append=torch.tensor([n]))

    def run_length(differs: torch.Tensor) -> tuple[int, int]:  # (number of runs, their common length)
        lengths = lengths_of(differs)
        if lengths.numel() == 1:
            return 1, n
        return lengths.numel(), math.gcd(*lengths[:-1].tolist()) if lengths.numel() > 2 else int(lengths[0])

    new_wg = wg[1:] != wg[:-1]
    nw, Lw = run_length(new_wg)
    new_run = new_wg | (ag[1:] != ag[:-1])
    na, La = run_length(new_run)
    if na > nw and La % 8 == 0 and (nw == 1 or Lw % La == 0):  # scales change inside weight groups
        first = torch.arange(0, n, Lw)
        w_scales, w_zeros = scales.float()[:, wg[first]], _pick(zeros, wg[first])
        w = IntActWeight.from_codes(codes[:, cols], bits, w_scales, w_zeros, Lw if nw > 1 else -1)
        sub = w.runs_per_group(La)
        gw = w.KP if w.G == 1 else Lw
        run_first = (torch.arange(w.G).unsqueeze(1) * gw + torch.arange(sub) * La).reshape(-1)
        return w, ag[run_first.clamp(max=n - 1)], La
    if na == 1:
        w = IntActWeight.from_codes(codes[:, cols], bits, scales.float()[:, wg[:1]], _pick(zeros, wg[:1]), -1)
        return w, ag[:1], 0
    if La % 8:
        lengths = lengths_of(new_run)
        return (
            f"columns of one weight group and one activation scale come in runs of "
            f"{sorted(set(lengths.tolist()))[:4]} (the integer path needs runs of a multiple of 8)"
        )
    first = torch.arange(0, n, La)  # the pieces' first columns (the last may be shorter)
    w_scales, w_zeros = scales.float()[:, wg[first]], _pick(zeros, wg[first])
    w = IntActWeight.from_codes(codes[:, cols], bits, w_scales, w_zeros, La)
    return w, ag[first], 0


def _pick(zeros, groups: torch.Tensor):
    return zeros.float()[:, groups] if torch.is_tensor(zeros) else zeros
