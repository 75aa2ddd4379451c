"""Issue 73 item 5: Algorithm 1 of the SQ-format paper as printed is an option of method
``sq-weights`` (``--importance paper --mask-timing upfront``; the default stays OBS saliency with
lazy masks).  On a real layer shape (SmolLM2-135M's ``k_proj``, 192 x 576) this checks that the
paper's masks are fixed before GPTQ's column loop starts and are, bank by bank, the top ``(1 - s)``
of ``I = W'^2 / diag(H^-1)^2`` (Alg. 1 line 4), with ``W'`` the smoothed weight and ``H`` the
Hessian of the smoothed inputs (Alg. 1 line 3: ``W', H <- Smooth(W, D)``), computed here
independently (float64 inverse, a per-bank sort) rather than through the method's helpers."""

import pytest
import torch

import bitmosaic.algorithms.sq as sq_alg
from bitmosaic.algorithms.smooth import smooth_scales
from bitmosaic.cli import build_parser, method_options
from bitmosaic.formats.sq import parse_sq
from bitmosaic.methods import get_method
from bitmosaic.methods.base import LayerStats
from bitmosaic.methods.sq_weights import quantize_sq_weights
from tests.conftest import correlated_inputs

OUT, IN = 192, 576  # SmolLM2-135M k_proj
SQ = "32-(8/4)-0.75"  # W(SQ6), the paper's best W(SQ)A4 cell


@pytest.fixture(scope="module")
def smoothed_layer():
    """``W'`` ``[192, 576]`` and ``H`` of the smoothed inputs (SmoothQuant alpha 0.5, the method's)."""
    X = correlated_inputs(2048, IN, seed=3)
    W = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.04
    s = smooth_scales(X.abs().amax(0), [W], 0.5)
    Wp, Xp = W * s[None, :], X / s[None, :]  # W' = W diag(s), X' = X diag(s)^-1: X' W'^T = X W^T
    H = 2 / Xp.shape[0] * Xp.T @ Xp
    return Wp.float(), H.float()


def paper_masks(Wp: torch.Tensor, H: torch.Tensor, sq: str, percdamp: float = 0.01) -> torch.Tensor:
    """Alg. 1 lines 4-8, independently: ``I = W'^2 / diag(H_damped^-1)^2``, then in every bank of
    every output channel the ``(1 - s) b`` largest ``I`` are high precision."""
    fmt = parse_sq(sq)
    H64 = H.double()
    Hd = H64 + percdamp * torch.diagonal(H64).mean() * torch.eye(H64.shape[0], dtype=torch.float64)
    d = torch.diagonal(torch.linalg.inv(Hd))
    imp = Wp.double().square() / d.square()[None, :]
    keep = round((1 - fmt.sparsity) * fmt.bank)
    banks = imp.reshape(OUT, IN // fmt.bank, fmt.bank)
    top = banks.argsort(dim=-1, descending=True)[..., :keep]
    mask = torch.zeros_like(banks, dtype=torch.bool).scatter_(-1, top, True)
    return mask.reshape(OUT, IN)


def _run(monkeypatch, Wp, H, **opts):
    """The method's weight result and the mask its quantizer held when GPTQ was entered."""
    seen = {}
    real = sq_alg.gptq_quantize

    def spy(W, H, *args, quantizer, **kw):
        seen["mask"] = quantizer.mask.clone()  # before the first column is quantized
        return real(W, H, *args, quantizer=quantizer, **kw)

    monkeypatch.setattr(sq_alg, "gptq_quantize", spy)
    cfg = get_method("sq-weights").make_config(sq=SQ, **opts)
    res = quantize_sq_weights(Wp, LayerStats(hessian=H), cfg)
    return res, seen["mask"]


def test_paper_masks_are_fixed_up_front_from_w_prime_and_h_inverse(monkeypatch, smoothed_layer):
    Wp, H = smoothed_layer
    want = paper_masks(Wp, H, SQ)
    res, at_entry = _run(monkeypatch, Wp, H, importance="paper", mask_timing="upfront")
    assert torch.equal(at_entry, want)  # chosen before the GPTQ loop...
    assert torch.equal(res.sq.mask, want)  # ...and never changed by it
    assert res.info["importance"] == "paper" and res.info["mask_timing"] == "upfront"
    # GPTQ still compensates through the fixed masks: not the plain rounding of W' with them
    plain = sq_alg.sq_gptq(Wp, H, parse_sq(SQ), importance="paper", compensate=False)
    assert torch.equal(plain.sq.mask, want) and not torch.equal(res.dequantize(), plain.dequantize())


def test_the_default_chooses_masks_lazily_and_differently(monkeypatch, smoothed_layer):
    Wp, H = smoothed_layer
    res, at_entry = _run(monkeypatch, Wp, H)  # defaults: obs saliency, lazy masks
    assert not at_entry.any()  # nothing chosen before the loop: each bank picks when GPTQ reaches it
    paper = paper_masks(Wp, H, SQ)
    differ = (res.sq.mask != paper).float().mean().item()
    assert differ > 0.01  # the two forms are different models (the option matters)


def test_cli_flags_select_the_paper_form_and_the_default_is_unchanged():
    p = build_parser()
    base = ["quantize", "--method", "sq-weights", "--sq", SQ, "--abits", "4"]
    spec = get_method("sq-weights")
    cfg = spec.make_config(**method_options(p.parse_args(base), spec))
    assert (cfg.importance, cfg.mask_timing) == ("obs", "lazy")
    args = p.parse_args([*base, "--importance", "paper", "--mask-timing", "upfront"])
    cfg = spec.make_config(**method_options(args, spec))
    assert (cfg.importance, cfg.mask_timing, cfg.scheme) == ("paper", "upfront", "W(SQ6)A4")
