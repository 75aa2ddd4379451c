"""Which code widths the 16-bit run-time activations (``--runtime-act int16``) speed up at decode: one row
of x through a weight-only ``QuantLinear`` (RTN, g128, asymmetric) on its default kernel (float
activations: the bit-plane LUT at 1-3 bits, ``LowBitWeight`` above) against the same layer with
``int16`` activations on the integer kernel (``IntActKernel``: the activation's two int8 halves in one pass
over the weight), per code width and shape, with this machine's read-bandwidth bound (the packed
weight's bytes / the measured read rate) beside them.  The load default
(``modules/intact.py`` ``DEFAULT_RUNTIME_MIN_BITS``) follows this table.

    python -m benchmarks.kernels.int16_widths [--threads 1,2] [--bits 2,3,4,5,6,8]
    (writes results/int16_widths.{md,json})
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import machine_bounds, machine_info, median_ms, write_results
from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.formats.grid import IntGrid
from bitmosaic.kernels.intmm import vnni
from bitmosaic.kernels.isa import kernel_isa
from bitmosaic.modules.intact import IntActKernel, set_runtime_activations
from bitmosaic.modules.qlinear import QuantLinear

SHAPES = ((576, 576), (1536, 576), (576, 1536), (4096, 4096))  # OUT x IN: SmolLM2's, an 8B model's


def measure(N: int, K: int, bits: int, bw: float, g: torch.Generator) -> dict:
    res = rtn_quantize(torch.randn(N, K, generator=g), IntGrid(bits, False), 128)
    layer = QuantLinear.from_result(res, bits=bits, group_size=128, symmetric=False)
    model = torch.nn.Sequential(layer)
    x = torch.randn(1, 1, K, generator=g)
    row = {"shape": f"{N}x{K}", "bits": bits}
    with torch.inference_mode():
        for mode in ("none", "int16", "none", "int16"):  # interleaved: the second pass is kept
            set_runtime_activations(model, mode)
            layer(x)
            if mode == "int16":
                assert isinstance(layer._int_act, IntActKernel), "int16 did not take the integer path"
            else:
                row["float_kernel"] = type(layer._kernel.weight).__name__
            row[f"{mode}_ms"] = median_ms(lambda: layer(x), budget_s=0.4)
    row["mem_bound_ms"] = layer.qweight.numel() * layer.qweight.element_size() / (bw * 1e9) * 1e3
    row["int16_speedup"] = row["none_ms"] / row["int16_ms"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| threads | shape | bits | float-activation kernel | weight-only ms | int16 ms | int16 speedup "
        "| mem bound ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['threads']} | {r['shape']} | {r['bits']} | {r['float_kernel']} | {r['none_ms']:.4f} "
            f"| {r['int16_ms']:.4f} | {r['int16_speedup']:.2f}x | {r['mem_bound_ms']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma list of thread counts")
    p.add_argument("--bits", default="2,3,4,5,6,8", help="comma list of code widths")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows, bounds = [], {}
    for t in (int(v) for v in a.threads.split(",")):
        rate, bw = machine_bounds(t)
        bounds[t] = {"int8_gops": rate, "read_gbs": bw}
        for N, K in SHAPES:
            for bits in (int(b) for b in a.bits.split(",")):
                r = {"threads": t, **measure(N, K, bits, bw, g)}
                print(table([r]).splitlines()[-1], flush=True)
                rows.append(r)
    isa = f"{kernel_isa()}{' + VNNI' if vnni() else ''}"
    md = (
        "# 16-bit run-time activations by code width (decode, one row)\n\n"
        f"Kernel ISA: {isa}. Read bandwidth per thread count: "
        + ", ".join(f"{t}: {b['read_gbs']:.1f} GB/s" for t, b in bounds.items())
        + ". Times: median ms of one layer call; speedup = weight-only time / int16 time, same run.\n\n"
        f"Reproduce: `python -m benchmarks.kernels.int16_widths --threads {a.threads} --bits {a.bits}`\n\n"
        + table(rows)
    )
    print("\n" + md)
    write_results(a.json, "int16_widths", {"bounds": bounds, "rows": rows, "machine": machine_info()}, md)


if __name__ == "__main__":
    main()
