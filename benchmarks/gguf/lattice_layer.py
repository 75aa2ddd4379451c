"""The vector GPTQ on a lattice codebook against nearest-point rounding, on one real SmolLM2 layer (issue 72).

One ``mlp.down_proj`` of SmolLM2-135M-Instruct (576 x 1536: its 1536 inputs are a multiple of the 256 a
lattice super-block needs), its Hessian ``H = X^T X / N`` from the layer's inputs over the 16 x 512 token
chunks of ``wikitext-2/valid.txt`` that ``llamacpp_peers`` calibrates on (the unquantized model's).  For
each type the scales are fitted once (``lattice_scales``, weighted by ``diag(H)``), then

- nearest-point rounding: each run of 8 (IQ3_S: 4) weights to its nearest codebook point under
  ``diag(H)`` for those scales (``lattice_rtn``);
- the vector GPTQ (``lattice_gptq``, the same scales) in natural order and in GPTQ's default order
  (``--method gptq``'s, act-order);

and the Hessian-weighted error ``tr((W - Q) H (W - Q)^T)`` of each, relative to ``tr(W H W^T)``.
Reproduce::

    flock /tmp/locks/heavy python -m benchmarks.gguf.lattice_layer --layer 4 --types IQ2_S,IQ2_XS
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gguf.llamacpp_peers import CALIB_CHUNKS, CTX, _data, calibration_chunks
from benchmarks.harness import write_results


def layer_hessian(model, tok, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, H)`` of ``model.layers.<layer>.mlp.down_proj`` over the calibration chunks."""
    lin = model.model.layers[layer].mlp.down_proj
    H = torch.zeros(lin.in_features, lin.in_features, dtype=torch.float64)
    count = [0]

    def hook(_m, args):
        x = args[0].detach().reshape(-1, lin.in_features).double()
        H.add_(x.T @ x)
        count[0] += x.shape[0]

    calib = calibration_chunks(tok, _data() / "wikitext-2" / "valid.txt", CALIB_CHUNKS, CTX)
    h = lin.register_forward_pre_hook(hook)
    try:
        with torch.inference_mode():
            for row in calib:
                model(row[None])
    finally:
        h.remove()
    return lin.weight.detach().float().clone(), (H / count[0]).float()


def compare(W: torch.Tensor, H: torch.Tensor, typ: str) -> dict:
    from bitmosaic.algorithms.gguf_grid import importance
    from bitmosaic.algorithms.gguf_lattice import lattice_gptq, lattice_rtn, lattice_scales
    from bitmosaic.formats import gguf_lattice as gl
    from bitmosaic.methods.common import processing_order
    from bitmosaic.methods.gptq import GPTQConfig

    def err(Q):
        E = (W - Q).double()
        return float(torch.einsum("oi,ij,oj->", E, H.double(), E))

    base = err(torch.zeros_like(W))
    d, s = lattice_scales(W, importance(H), gl.LATTICE_TYPES[typ])
    rows = {"nearest point": err(lattice_rtn(W, typ, d, s, importance(H)).dequantize())}
    for label, perm in (("vector GPTQ, natural order", None),
                        ("vector GPTQ, default order", processing_order(H, GPTQConfig()))):  # fmt: skip
        rows[label] = err(lattice_gptq(W, H, typ, perm=perm).dequantize())
    return {k: {"error": v, "relative": v / base} for k, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layer", type=int, default=4)
    p.add_argument("--types", default="IQ2_S,IQ2_XS")
    a = p.parse_args()
    from bitmosaic.io import load_model
    from bitmosaic.kernels import lattice_search

    lattice_search.install()
    model, tok = load_model(a.model)
    W, H = layer_hessian(model, tok, a.layer)
    res = {typ: compare(W, H, typ) for typ in a.types.split(",")}
    lines = [f"# Vector GPTQ vs nearest-point rounding: {a.model} layer {a.layer} mlp.down_proj "
             f"({W.shape[0]} x {W.shape[1]})", "",
             "Hessian-weighted error tr((W-Q) H (W-Q)^T) / tr(W H W^T), the same stored scales in each row.",
             "",
             "| type | nearest point | vector GPTQ, natural order | vector GPTQ, default order |",
             "|---|---|---|---|"]  # fmt: skip
    for typ, r in res.items():
        cells = [f"{r[k]['relative']:.4f}" for k in
                 ("nearest point", "vector GPTQ, natural order", "vector GPTQ, default order")]  # fmt: skip
        lines.append(f"| {typ} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    write_results(None, "gguf_lattice_layer", {"model": a.model, "layer": a.layer, "shape": list(W.shape),
                                               "types": res}, "\n".join(lines))  # fmt: skip


if __name__ == "__main__":
    main()
