"""Q4_0 / Q5_0 scales for GPTQ: llama.cpp's importance-weighted fit against the generic MSE search, on real
SmolLM2 layers (issue 72).

llama.cpp writes ``Q4_0`` / ``Q5_0`` for most of SmolLM2's tensors in its k-quant presets (the 576- and
1536-wide fallbacks: Q4_K_M holds 166 ``Q5_0`` tensors, Q3_K_M 120 ``Q4_0``, Q2_K 180 ``Q4_0``) and for
all of them in the ``Q4_0`` preset.  Two ways to fix each block's fp16 ``d`` before the same GPTQ solve
(act-order, static groups of 32):

- *generic*: bitmosaic's integer-grid MSE search (``2 max|w| / 15`` shrunk over 80 candidates, error
  ``|w - Q(w)|^2.4`` unweighted), what ``--gguf-type`` used for these types before;
- *llama.cpp's fit*: ``make_qx_quants`` weighted by ``diag(H)`` (:func:`bitmosaic.algorithms.gguf_legacy.qx`:
  the signed extreme on ``-nmax``, 19 inverse scales, the weighted least-squares scale of each);

and, for scale, the nearest rounding with llama.cpp's fit (no GPTQ: what ``llama-quantize --imatrix`` does
up to its weights ``sqrt(sigma2 + x^2)``).  Each cell is ``tr((W - Q) H (W - Q)^T) / tr(W H W^T)`` with
``H`` from the unquantized model's inputs over the 16 x 512 token chunks ``llamacpp_peers`` calibrates on.
Reproduce::

    flock /tmp/locks/heavy python -m benchmarks.gguf.legacy_layer --layers 2,15,28
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gguf.llamacpp_peers import CALIB_CHUNKS, CTX, _data, calibration_chunks
from benchmarks.harness import write_results

NAMES = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")


def hessians(model, tok, layers: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (W, H)}`` of the :data:`NAMES` linears of ``layers`` over the calibration chunks."""
    acc: dict[str, list] = {}
    hooks = []
    for i in layers:
        for n in NAMES:
            lin = model.model.layers[i].get_submodule(n)
            key = f"layers.{i}.{n}"
            acc[key] = [lin, torch.zeros(lin.in_features, lin.in_features, dtype=torch.float64), 0]

            def hook(m, args, a=acc[key]):
                x = args[0].detach().reshape(-1, m.in_features).double()
                a[1].add_(x.T @ x)
                a[2] += x.shape[0]

            hooks.append(lin.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            for row in calibration_chunks(tok, _data() / "wikitext-2" / "valid.txt", CALIB_CHUNKS, CTX):
                model(row[None])
    finally:
        for h in hooks:
            h.remove()
    return {k: (lin.weight.detach().float().clone(), (H / n).float()) for k, (lin, H, n) in acc.items()}


def compare(W: torch.Tensor, H: torch.Tensor, typ: str) -> dict[str, float]:
    from bitmosaic.algorithms import gguf_legacy as gl
    from bitmosaic.algorithms.gguf_grid import SYM_NMAX, importance, legacy_sym_gptq
    from bitmosaic.algorithms.gptq import gptq_quantize
    from bitmosaic.formats.grid import IntGrid
    from bitmosaic.methods.common import processing_order
    from bitmosaic.methods.gptq import GPTQConfig

    def err(Q):
        E = (W - Q).double()
        return float(torch.einsum("oi,ij,oj->", E, H.double(), E))

    nmax, perm = SYM_NMAX[typ], processing_order(H, GPTQConfig())
    generic = gptq_quantize(W, H, IntGrid(nmax.bit_length(), True), 32, perm=perm, scale_method="mse",
                            static_groups=True)  # fmt: skip
    d = gl.fit_sym(W, importance(H), nmax).float()[..., None]
    nearest = ((W.reshape(W.shape[0], -1, 32) / d).round().clamp(-nmax, nmax - 1) * d).reshape(W.shape)
    base = err(torch.zeros_like(W))
    return {
        "GPTQ, generic MSE scales": err(generic.dequantize()) / base,
        "GPTQ, llama.cpp's fit": err(legacy_sym_gptq(W, H, typ, perm=perm).dequantize()) / base,
        "nearest, llama.cpp's fit": err(nearest) / base,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", default="2,15,28")
    p.add_argument("--types", default="Q4_0,Q5_0")
    a = p.parse_args()
    from bitmosaic.io import load_model

    torch.set_num_threads(2)
    model, tok = load_model(a.model)
    hs = hessians(model, tok, [int(x) for x in a.layers.split(",")])
    res = {typ: {k: compare(W, H, typ) for k, (W, H) in hs.items()} for typ in a.types.split(",")}
    cols = ("GPTQ, generic MSE scales", "GPTQ, llama.cpp's fit", "nearest, llama.cpp's fit")
    lines = [f"# Q4_0 / Q5_0 scales for GPTQ on {a.model} (layers {a.layers})", "",
             "Hessian-weighted error tr((W-Q) H (W-Q)^T) / tr(W H W^T); the last column of each type: "
             "llama.cpp's fit over the generic search, both with GPTQ.", "",
             "| type | linear | " + " | ".join(cols) + " | fit / generic |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for typ, rows in res.items():
        for k, r in rows.items():
            ratio = r[cols[1]] / r[cols[0]]
            lines.append(f"| {typ} | {k} | " + " | ".join(f"{r[c]:.6f}" for c in cols) + f" | {ratio:.3f} |")
        tot = [sum(r[c] for r in rows.values()) for c in cols]
        cells = " | ".join(f"{t:.6f}" for t in tot)
        lines.append(f"| {typ} | sum | {cells} | {tot[1] / tot[0]:.3f} |")
    print("\n".join(lines))
    write_results(None, "gguf_legacy_layer", {"model": a.model, "layers": a.layers, "types": res},
                  "\n".join(lines))  # fmt: skip


if __name__ == "__main__":
    main()
