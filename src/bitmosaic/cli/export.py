"""``bitmosaic export DIR --format {gptq,compressed-tensors,gguf} --out OUT``: a saved result as a checkpoint
that transformers, vLLM, SGLang and GPTQModel load, or as a GGUF file for llama.cpp (see
:mod:`bitmosaic.io.export`)."""

from __future__ import annotations

import re

HELP = (
    "write a saved bitmosaic model as a GPTQ or compressed-tensors checkpoint (vLLM, transformers, "
    "GPTQModel) or as a GGUF file (llama.cpp). Symmetric 4/8-bit results (quantize --sym) are what vLLM's "
    "fast Marlin kernels take; GGUF Q4_0/Q8_0 hold symmetric and Q4_1 asymmetric results with groups of "
    "a multiple of 32 in natural order."
)


def add_export_parser(sub) -> None:
    x = sub.add_parser("export", help=HELP, description=HELP)
    x.add_argument(
        "dir",
        help="a folder saved by `bitmosaic quantize --out` (--format gguf also takes a float model: "
        "smollm2-135m, gguf:PATH, a folder)",
    )
    x.add_argument("--format", dest="fmt", required=True, choices=["gptq", "compressed-tensors", "gguf"])
    x.add_argument(
        "--out", required=True, help="new output folder, or FILE.gguf for gguf (written atomically)"
    )
    x.add_argument(
        "--gguf-type",
        type=str.upper,
        metavar="TYPE",
        help="gguf: the type of the quantized matrices, Q4_0 Q4_1 Q5_0 Q5_1 Q8_0, the k-quants Q2_K Q3_K "
        "Q4_K Q5_K Q6_K (their sub-block scales refitted to our integers: lossy, needs --lossy; layers "
        "quantized with gptq --gguf-type on a type's grid: exact), IQ4_NL IQ4_XS (only those) or F32 F16 "
        "BF16 "
        "(default: the smallest that holds the weights exactly for their bits and symmetry; a float model: "
        "per tensor, the first of F16, BF16, F32 that holds it exactly)",
    )
    x.add_argument(
        "--source-gguf",
        metavar="FILE",
        help="gguf: the GGUF file to take metadata, tokenizer and tensor names from (default: the one the "
        "model was loaded from, as the saved folder records it)",
    )
    x.add_argument(
        "--lossy",
        action="store_true",
        help="export layers no format holds exactly in their nearest representable form and print the "
        "weight error that adds (default: refuse them, naming why)",
    )
    x.add_argument(
        "--gptq-format",
        choices=("auto", "v1", "v2"),
        default="auto",
        help="GPTQ: checkpoint_format gptq (v1: stores zero-1, cannot hold a zero of 0; GPTQModel refuses "
        "it for asymmetric checkpoints) or gptq_v2 (zeros as they are); auto (default): v2 when any layer "
        "is asymmetric, else v1",
    )
    x.add_argument(
        "--gptq-v2", action="store_const", const="v2", dest="gptq_format", help="= --gptq-format v2"
    )
    x.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")


_GPTQ_V2 = {"auto": None, "v1": False, "v2": True}


def cmd_export(args) -> int:
    from ..io.export import export_model

    res = export_model(
        args.dir, args.out, args.fmt, lossy=args.lossy, gptq_v2=_GPTQ_V2[args.gptq_format],
        overwrite=args.overwrite,
        gguf_type=args.gguf_type, source_gguf=args.source_gguf,
    )  # fmt: skip
    s = res.summary()
    print(f"exported {s['layers']} quantized layers as {res.format} to {res.out}")
    for note in res.notes:
        print(f"note: {note}")
    if res.changed:
        kinds: dict[str, list] = {}
        for r in res.changed:
            for c in r.changes:  # one row per kind of change (numbers in the text vary per layer)
                kinds.setdefault(re.sub(r"(?<![\w.])-?\d+(\.\d+)?(?!\w)", "N", c), []).append(r)
        print(
            f"lossy: {s['changed_layers']} layer(s) changed; weight error added "
            f"(relative Frobenius, max |diff|):"
        )
        print("| change | layers | their mean rel err | max rel err | max abs diff |")
        print("|---|---:|---:|---:|---:|")
        for what, rs in kinds.items():
            rel = [r.rel_err for r in rs]
            print(
                f"| {what} | {len(rs)} | {sum(rel) / len(rel):.3e} | {max(rel):.3e} | "
                f"{max(r.max_abs for r in rs):.3e} |"
            )
        print(
            f"all layers: mean rel err {s['mean_rel_err']:.3e}, max rel err {s['max_rel_err']:.3e}, "
            f"max abs diff {s['max_abs']:.3e}"
            + ("" if res.format == "gguf" else f" (per layer in {res.out}/bitmosaic_export.json)")
        )
    else:
        print("exact: every exported weight is bit-identical to the bitmosaic model's")
    return 0
