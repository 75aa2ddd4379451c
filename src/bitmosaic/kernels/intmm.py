"""Integer-activation matmul on the CPU: ``y = Q(x) Wᵀ`` in int8 x integer codes, int32 sums per weight group.

The simulated activation path (:func:`bitmosaic.formats.act.fake_quant`) multiplies ``Q(x) = q s_a`` by
the float weight ``(c - z) s_w`` in float32.  This kernel computes the same thing in integers: the
activations are quantized to ``q = clamp(round(x / s_a), -qmax - 1, qmax)`` (int8; the scales ``s_a``
come from :func:`bitmosaic.formats.act.act_scales`, the simulated path's own function, so ``q`` is
exactly the simulated path's integers), and per output ``(m, n)`` and weight group ``g``::

    acc = Σ_{j ∈ g} c[n, j] q[m, j]                     exact, int32 (u8 codes x s8 activations)
    y  += (acc - z[n, g] Σ_{j ∈ g} q[m, j]) · (s_w[n, g] s_a[m, g])      float32

so ``y`` equals the simulated output up to float32 rounding of the scale products (the simulated path
rounds every product and partial sum instead).  INT2-INT8 activations run the same way (INT4 values held
in int8).  **16-bit activations** (``qmax =`` :data:`~bitmosaic.formats.act.INT16_SPLIT_QMAX` = 127·256 +
127) run as two int8 halves ``q = 256 h + l`` (``h = ⌊(q + 128) / 256⌋``, ``l = q - 256 h``): the halves are
two rows of x with scales ``256 s_a`` and ``s_a`` through the same kernel, which unpacks each weight
register once for both, and ``y`` is the sum of their products -- the 16-bit integers exactly, for about
the weight traffic of one int8 row (the run-time ``int16`` decode activations of weight-only layers,
:mod:`bitmosaic.modules.intact`).

Layout (built once from the codes by :meth:`IntActWeight.from_codes`; ``csrc/intmm_common.h``): row
blocks of 16 output rows; columns in pairs of 4-column chunks; codes of widths 1-4 as nibbles (one
64-byte tile per 8 columns: byte ``4 r + j`` = code ``(r, 8p + j)`` | code ``(r, 8p + 4 + j)`` << 4),
widths 5-8 as bytes (two 64-byte tiles); a register holds 16 (AVX2: 8) rows x 4 columns, so one
``vpdpbusd`` (AVX2: ``vpmaddubsw`` + ``vpmaddwd``) against 4 broadcast activations adds 4 products to each
row's int32 lane, and the per-group epilogue needs no horizontal sum.  Widths 1-3 take 4 bits here.

Kernels (``csrc/intmm.cpp``): AVX-512 VNNI, AVX2 and portable C++, chosen per call like the other
kernels (:func:`bitmosaic.kernels.isa.kernel_isa`; ``avx512`` without VNNI runs the AVX2 body).  On a CPU
with AMX-INT8 (Intel Sapphire Rapids and later) the ``avx512`` ISA runs prefill -- 16 or more rows of x,
groups of whole 64-column steps -- on AMX tiles (``csrc/intmm_amx.h``: one ``tdpbsud`` is 16 x 16 x 64
products; the same epilogue, so the same outputs bit for bit; :func:`amx`, ``$BITMOSAIC_AMX=0`` opts
out).  A second route, ``torch._int_mm`` (oneDNN int8 GEMM) once per weight group on an unpacked int8
copy of the weight, is kept for measurement (``route="int_mm"``, ``benchmarks/kernels/int_gemm.py``).

Capabilities (:mod:`bitmosaic.kernels.select`): one width 1-8 per matrix, CPU, group sizes that are
multiples of 8 (or one group per row), input width below ``MAX_K``; without the compiled extension
it runs the ``torch._int_mm`` route (same integers; slower at decode).
"""

from __future__ import annotations

import torch

from ..formats.act import INT16_SPLIT_QMAX
from . import build, ops

__all__ = ["IntActWeight", "extension", "MAX_K"]

MAX_K = 65536  # |acc| <= 255 * 128 * K stays below 2**31
_ROWS = 16  # rows per row block
_COLS = 8  # columns per pair


def extension():
    """The compiled ``intmm`` extension, or ``None`` (no compiler, failed build, ``BITMOSAIC_NO_EXT=1``)."""
    return build.load("intmm")


def vnni() -> bool:
    """Whether the ``avx512`` ISA runs AVX-512 VNNI here (``vpdpbusd``)."""
    ext = extension()
    return bool(ext is not None and ext.vnni_supported())


AMX_ENV = "BITMOSAIC_AMX"  # "0": prefill on the VNNI body even where AMX runs (read per call)


def amx() -> bool:
    """Whether the ``avx512`` ISA runs prefill (16 or more rows of x) on AMX-INT8 tiles here: the CPU has
    AMX-TILE and AMX-INT8 and Linux gave the process the tile state (``csrc/intmm_amx.h``; the same
    outputs as the VNNI body bit for bit), unless ``$BITMOSAIC_AMX=0`` (the kernel's own decision,
    ``amx_enabled`` in ``csrc/intmm_amx.h``)."""
    ext = extension()
    return bool(ext is not None and ext.amx_enabled())


class IntActWeight:
    """A weight in the integer layout (module doc); :meth:`matmul` quantizes ``x`` and multiplies in int."""

    KERNEL_NAME = "int8act"
    SUPPORTS_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_DEVICES = ("cpu",)
    SUPPORTS_GROUP_SIZE_MULTIPLE = 8
    SUPPORTS_ROWS = (1, None)
    FAST_BITS = SUPPORTS_BITS
    NEEDS_COMPILED = False  # the torch._int_mm route runs without it

    @staticmethod
    def compiled() -> bool:
        return extension() is not None

    def __init__(self, data, sc, zc, N, K, group_size, bits):
        self.data, self.sc, self.zc = data, sc, zc
        self.N, self.K, self.group_size, self.bits = N, K, group_size, bits
        self.G = sc.shape[1]
        self.KP = -(-K // _COLS) * _COLS
        self._int8: torch.Tensor | None = None  # [KP, N] int8 (c - 128) for the torch._int_mm route

    @classmethod
    def from_codes(cls, codes: torch.Tensor, bits: int, scales: torch.Tensor, zeros, group_size: int):
        """From integer ``codes [N, K]`` in ``[0, 2**bits)``, ``scales [N, G]``, ``zeros [N, G]`` or a
        number, ``group_size`` (``-1`` or ``>= K``: one group per row; else a multiple of 8)."""
        if not torch.is_tensor(codes) or codes.dim() != 2 or codes.is_floating_point():
            raise ValueError("codes must be a 2-D integer tensor [out, in]")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
        N, K = codes.shape
        if K >= MAX_K:
            raise ValueError(f"the integer path takes fewer than {MAX_K} input columns, got {K}")
        gs = K if group_size is None or group_size < 0 or group_size >= K else int(group_size)
        G = -(-K // gs) if K else 1
        if G > 1 and gs % _COLS:
            raise ValueError(f"the integer path needs a group size that is a multiple of {_COLS}, got {gs}")
        if tuple(scales.shape) != (N, G):
            raise ValueError(f"scales must be [out={N}, groups={G}], got {tuple(scales.shape)}")
        z = zeros.float() if torch.is_tensor(zeros) else torch.full((N, G), float(zeros))
        if tuple(z.shape) != (N, G):
            raise ValueError(f"zeros must be a number or [out={N}, groups={G}], got {tuple(z.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
            raise ValueError(f"codes lie in [{int(codes.min())}, {int(codes.max())}], outside {bits} bits")
        nrb, KP = -(-N // _ROWS), -(-K // _COLS) * _COLS
        NP = nrb * _ROWS
        c = torch.nn.functional.pad(codes.to(torch.uint8), (0, KP - K, 0, NP - N))
        c = c.reshape(nrb, _ROWS, KP // _COLS, 2, 4)
        if bits <= 4:
            c = c.permute(0, 2, 1, 3, 4)
            data = c[..., 0, :] | (c[..., 1, :] << 4)
        else:
            data = c.permute(0, 2, 3, 1, 4)
        data = data.contiguous().reshape(-1)

        def tiles(t: torch.Tensor) -> torch.Tensor:
            t = torch.nn.functional.pad(t.float(), (0, 0, 0, NP - N))
            return t.reshape(nrb, _ROWS, G).permute(0, 2, 1).contiguous()

        return cls(data, tiles(scales), tiles(z), N, K, gs, bits)

    def nbytes(self) -> int:
        extra = 0 if self._int8 is None else self._int8.numel()
        return self.data.numel() + 4 * (self.sc.numel() + self.zc.numel()) + extra

    def codes(self, rows: slice | None = None) -> torch.Tensor:
        """The integer codes ``[N, K]`` (int32) read back out of the layout, or those of ``rows`` (a
        slice of step 1: only their row blocks are read)."""
        r0, r1 = (0, self.N) if rows is None else (rows.start or 0, min(self.N, rows.stop or self.N))
        b0, b1 = r0 // _ROWS, -(-r1 // _ROWS)
        per_block = self.data.numel() // self.sc.shape[0]
        d = self.data[b0 * per_block : b1 * per_block]
        d = d.reshape(b1 - b0, self.KP // _COLS, *((2, _ROWS, 4) if self.bits > 4 else (_ROWS, 4)))
        if self.bits > 4:
            c = d.permute(0, 3, 1, 2, 4)
        else:
            c = torch.stack((d & 15, d >> 4), dim=3).permute(0, 2, 1, 3, 4)
        c = c.reshape((b1 - b0) * _ROWS, self.KP)
        return c[r0 - b0 * _ROWS : r1 - b0 * _ROWS, : self.K].to(torch.int32)

    def scales(self) -> torch.Tensor:
        return self.sc.permute(0, 2, 1).reshape(-1, self.G)[: self.N]

    def zeros(self) -> torch.Tensor:
        return self.zc.permute(0, 2, 1).reshape(-1, self.G)[: self.N]

    # -- the call -------------------------------------------------------------------------------
    def _ratio(self, act_scale: torch.Tensor | None, act_group: int) -> int:
        Ga = (
            (-(-self.K // act_group) if act_group < self.K else 1)
            if act_scale is None
            else act_scale.shape[1]
        )
        if Ga == 1:
            return self.G
        if self.G == 1 or act_group % self.group_size:
            raise ValueError(
                f"activation groups of {act_group} columns do not hold whole weight groups "
                f"of {self.group_size}"
            )
        return act_group // self.group_size

    def quantize(self, x2: torch.Tensor, act_scale: torch.Tensor | None, act_group: int, qmax: float):
        """``(q [M, KP] int8, qsum [M, G] int32, scales)``: ``x2 [M, K]`` float32 quantized with
        ``act_scale`` ``[1 or M, Ga]`` (``act_group`` columns per scale column) to ``[-qmax - 1, qmax]``;
        ``act_scale=None``: dynamic scales per token (``act_group >= K``) or per token and group of
        ``act_group`` columns, ``max(amax / qmax, 1e-12)`` (``scale_from_amax``)."""
        return ops.int8_quantize(x2, act_scale, act_group, float(qmax), self.KP, self.group_size, self.G)

    def matmul(self, x: torch.Tensor, act_scale, act_group: int, qmax: float, route: str = "kernel"):
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype; ``act_scale [1 or M, Ga]`` float32 (per token:
        ``[M, 1]``, per tensor ``[1, 1]``, per activation group ``[., Ga]`` with ``act_group`` columns per
        scale, a multiple of the weight group size; ``None``: dynamic per-token, computed in the kernel).
        ``route``: ``"kernel"`` (the compiled kernel) or ``"int_mm"`` (``torch._int_mm`` per weight group)."""
        if route == "kernel" and extension() is not None:  # quantize and multiply in one operator
            x2, act_scale, ratio = self._checked(x, act_scale, act_group)
            y = ops.int_linear(
                x2, act_scale, act_group, float(qmax), self.KP, ratio, self.data, self.sc, self.zc, self.N,
                self.G, self.group_size, self.bits > 4, self.bits == 8,
            )  # fmt: skip
        else:
            q, qsum, sa, ratio = self.quantized(x, act_scale, act_group, qmax)
            y = self.product(q, qsum, sa, ratio, route)
            if qmax == INT16_SPLIT_QMAX:  # 16-bit activations: the high halves' product plus the low's
                y = y[: y.shape[0] // 2] + y[y.shape[0] // 2 :]
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    def quantized(self, x: torch.Tensor, act_scale, act_group: int, qmax: float):
        """:meth:`quantize` of ``x [..., K]`` with :meth:`matmul`'s arguments, and the ``ratio`` (weight
        groups per activation scale column) :meth:`product` takes: ``(q, qsum, scales, ratio)``."""
        x2, act_scale, ratio = self._checked(x, act_scale, act_group)
        return (*self.quantize(x2, act_scale, act_group, qmax), ratio)

    def _checked(self, x: torch.Tensor, act_scale, act_group: int):
        """``(x [M, K] float32, act_scale [1 or M, Ga] float32 or None, ratio)`` for the calls above."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        if act_scale is not None:
            act_scale = act_scale.float().reshape(act_scale.shape[0] if act_scale.dim() == 2 else 1, -1)
        ratio = self._ratio(act_scale, act_group)  # per token / per tensor: one scale column
        return x.reshape(-1, self.K).float(), act_scale, ratio

    def product(self, q, qsum, sa, ratio: int, route: str = "kernel") -> torch.Tensor:
        """``y [M, N]`` float32 from :meth:`quantize`'s ``(q, qsum, sa)`` (``q`` may come from another
        weight's call when its columns are these: MosaicQuant's residual,
        :class:`.mosaic.MosaicIntActWeight`); ``ratio``: weight groups per activation scale column."""
        ext = extension()
        if route == "kernel" and ext is not None:
            y = ops.int_matmul(
                q, qsum, sa, ratio, self.data, self.sc, self.zc, self.N, self.G, self.group_size,
                self.bits > 4, self.bits == 8,
            )  # fmt: skip
        elif route in ("kernel", "int_mm"):
            y = self._int_mm(q, qsum, sa, ratio)
        else:
            raise ValueError(f"route must be 'kernel' or 'int_mm', got {route!r}")
        return y

    def runs_per_group(self, run: int) -> int:
        """How many activation runs of ``run`` columns a weight group holds in :meth:`product_runs`."""
        if run < 8 or run % 8 or (self.G > 1 and self.group_size % run):
            raise ValueError(
                f"activation runs of {run} columns must be a multiple of 8 that divides the "
                f"weight group size {self.group_size}"
            )
        return -(-(self.KP if self.G == 1 else self.group_size) // run)

    def run_sums(self, q: torch.Tensor, sa: torch.Tensor, run: int) -> torch.Tensor:
        """``qz [M, G]`` float32: per weight group, ``Σ_r s_a(r) Σ_{j ∈ r} q_j`` over its runs of ``run``
        columns (``sa [1 or M, G * runs per group]``), the zero-point term :meth:`product_runs` needs."""
        sub = self.runs_per_group(run)
        M = q.shape[0]
        qs = torch.nn.functional.pad(q, (0, self.G * sub * run - q.shape[1])).reshape(M, self.G, sub, run)
        qs = qs.sum(-1, dtype=torch.int32).float()
        return (qs * sa.float().reshape(sa.shape[0], self.G, sub)).sum(-1)

    def product_runs(self, q, qz, sa, run: int, route: str = "kernel") -> torch.Tensor:
        """``y [M, N]`` float32 from ``q [M, KP]`` int8 whose activation scale changes every ``run``
        columns inside the weight groups (a multiple of 8 dividing the group size): ``sa [1 or M, G *
        runs per group]`` holds run ``r`` of group ``g`` at column ``g * runs + r`` (a shorter last group
        leaves its unused columns unread), ``qz`` = :meth:`run_sums`.  Per group the kernel adds each
        run's exact int32 sum times its scale into a float sum, then applies the weight scale and the
        zero-point term once: ``y += s_w (Σ_r s_a(r) acc(r) - z qz)`` -- equal to giving every run its own
        group (:meth:`product`) up to float32 rounding, with about half the per-run work (SQ-format's
        8-column runs, :class:`~bitmosaic.modules.sq.SQActLinear`)."""
        sub = self.runs_per_group(run)
        if tuple(qz.shape) != (q.shape[0], self.G) or sa.shape[-1] != self.G * sub:
            raise ValueError(f"qz must be [M, {self.G}] and the run scales [., {self.G * sub}]")
        if route == "kernel" and extension() is not None:
            return ops.int_matmul_runs(
                q, qz.float().contiguous(), sa.float().contiguous(), run, self.data, self.sc, self.zc, self.N,
                self.G, self.group_size, self.bits > 4, self.bits == 8,
            )  # fmt: skip
        if route not in ("kernel", "int_mm"):
            raise ValueError(f"route must be 'kernel' or 'int_mm', got {route!r}")
        return self._int_mm_runs(q, qz, sa.float(), run, sub)

    def _int_mm_runs(self, q, qz, sa, run: int, sub: int) -> torch.Tensor:
        """:meth:`product_runs` with ``torch._int_mm`` per run on ``c - 128`` (int8)."""
        i8 = self._int8_copy()
        s, z = self.scales(), self.zeros()
        gw = self.KP if self.G == 1 else self.group_size
        y = torch.zeros(q.shape[0], self.N)
        for g in range(self.G):
            fg = torch.zeros(q.shape[0], self.N)
            for r in range(sub):
                c0 = g * gw + r * run
                c1 = min(c0 + run, self.KP, (g + 1) * gw if g < self.G - 1 else self.KP)
                if c0 >= c1:
                    break
                acc = torch._int_mm(q[:, c0:c1].contiguous(), i8[c0:c1].contiguous()).float()
                acc += 128 * q[:, c0:c1].sum(1, dtype=torch.int32).float().unsqueeze(1)
                fg += acc * sa[:, g * sub + r].unsqueeze(1)
            y += (fg - z[:, g] * qz[:, g : g + 1]) * s[:, g]
        return y

    def _int8_copy(self) -> torch.Tensor:
        """``[KP, N]`` int8 ``c - 128`` (the ``torch._int_mm`` routes), built once."""
        if self._int8 is None:
            c = torch.nn.functional.pad(self.codes(), (0, self.KP - self.K))
            self._int8 = (c - 128).to(torch.int8).T.contiguous()
        return self._int8

    def _int_mm(self, q, qsum, sa, ratio) -> torch.Tensor:
        """``torch._int_mm`` per weight group on ``c - 128`` (int8), corrected by ``128 Σ q``."""
        i8 = self._int8_copy()
        M = q.shape[0]
        s, z = self.scales(), self.zeros()
        y = torch.zeros(M, self.N)
        for g in range(self.G):
            c0, c1 = g * self.group_size, self.KP if g == self.G - 1 else (g + 1) * self.group_size
            acc = torch._int_mm(q[:, c0:c1], i8[c0:c1]).float()
            qs = qsum[:, g : g + 1].float()
            sag = sa[:, min(g // ratio, sa.shape[1] - 1)].unsqueeze(1)
            y.add_((acc + (128 - z[:, g]) * qs) * (s[:, g] * sag))
        return y
