"""Perplexity over non-overlapping windows -- the standard protocol of the GPTQ paper and its successors.

The token stream ``[1, N]`` (see :func:`bitmosaic.data.eval_tokens`) is cut into ``N // seqlen``
non-overlapping windows of ``seqlen`` tokens (the tail is dropped).  Each window is run through the model on
its own (no context carried over) and scores its tokens ``1 .. seqlen-1``, each predicted from its prefix
inside the window: ``seqlen - 1`` predicted tokens per window.  The perplexity is
``exp(sum of NLL / number of predicted tokens)``; the per-token NLL is computed in float32 from each batch's
logits (never more than one batch of logits is held) and summed in float64.

This is the GPTQ reference computation (there: ``exp(mean over windows of (mean NLL * seqlen) / seqlen)``,
the same number, since every window predicts the same number of tokens).

BOS.  For models trained with a BOS at the start of every sequence (``bos_token_id`` given; see
:func:`bitmosaic.data.bos_token_id`), each window is ``[BOS] + (seqlen - 1)`` consecutive text tokens, as
in lm-eval-harness's rolling log-likelihood (which prefixes each window with the prefix token): the BOS
position is input only, and all ``seqlen - 1`` text tokens are scored, the first from BOS alone.  Windows
then advance by ``seqlen - 1`` text tokens and still predict ``seqlen - 1`` tokens each.  Without
``bos_token_id`` nothing changes.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from ..errors import DeviceError, NonFiniteError
from .fidelity import FidelityMeter, token_nll

__all__ = ["perplexity", "eval_windows", "window_nll"]


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def perplexity(
    model,
    tokens: torch.Tensor,
    seqlen: int,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    device: str | torch.device | None = None,
    bos_token_id: int | None = None,
    reference=None,
    per_window: bool = False,
) -> dict:
    """Perplexity of ``model`` on ``tokens`` (LongTensor ``[1, N]``) over windows of ``seqlen`` tokens.

    ``model(input_ids, use_cache=False)`` must return an object with ``.logits`` ``[batch, seqlen, vocab]``
    (a Hugging Face causal LM does).  ``max_windows`` keeps only the first windows; ``batch_size`` windows
    go through the model at once (the result does not depend on it).  ``device``: run there (the model
    is moved for the evaluation and moved back after; ``None``: where the model is).
    ``bos_token_id``: for models trained with a BOS (see :func:`bitmosaic.data.bos_token_id`), each
    window is BOS + ``seqlen - 1`` text tokens and the BOS position is not scored; the result says
    ``"bos": True``.
    ``reference``: a model with the same vocabulary (the float model) run on the same windows where it
    is; the result then also holds ``kl_mean``, ``kl_p99`` (nats per token, KL(reference || model)),
    ``top1_agreement`` and ``compared_tokens``.
    ``per_window``: the result also holds ``window_nll``, each window's mean NLL per predicted token
    (a list of floats, window order), for a paired bootstrap of two models on the same windows
    (:func:`bitmosaic.eval.bootstrap.bootstrap_ratio`).

    Returns ``{"ppl", "nll" (mean NLL per predicted token), "tokens" (predicted tokens), "windows",
    "seqlen", "bos" (whether windows started with BOS)}``.  A model that does not fit on ``device`` raises
    :class:`~bitmosaic.errors.DeviceError` (the model is put back first); NaN or Inf logits on a window
    raise :class:`~bitmosaic.errors.NonFiniteError` naming the first such window (never a NaN perplexity).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = eval_windows(tokens, seqlen, max_windows, bos_token_id)
    windows = ids.shape[0]

    home = _model_device(model)
    device = home if device is None else torch.device(device)
    meter = FidelityMeter() if reference is not None else None
    sums: list[float] | None = [] if per_window else None  # each window's summed NLL
    if device == home:
        total_nll = _total_nll(model, ids, batch_size, device, progress, reference, meter, sums)
    else:
        try:
            model.to(device)
            total_nll = _total_nll(model, ids, batch_size, device, progress, reference, meter, sums)
        except torch.OutOfMemoryError:  # the finally below puts the model back first
            raise DeviceError(
                f"the model does not fit on {device} for the evaluation; use --device cpu "
                "(or a smaller --batch-size / model)"
            ) from None
        finally:
            model.to(home)

    predicted = windows * (seqlen - 1)
    mean_nll = total_nll / predicted
    out = {
        "ppl": _exp(mean_nll),
        "nll": mean_nll,
        "tokens": predicted,
        "windows": windows,
        "seqlen": seqlen,
        "bos": bos_token_id is not None,
    }
    if meter is not None:
        out.update(meter.summary())
    if sums is not None:
        out["window_nll"] = [x / (seqlen - 1) for x in sums]
    return out


def eval_windows(
    tokens: torch.Tensor, seqlen: int, max_windows: int | None = None, bos_token_id: int | None = None
) -> torch.Tensor:
    """The windows :func:`perplexity` scores, ``[windows, seqlen]`` (see the module doc): the token
    stream cut into non-overlapping windows (each ``[BOS] + seqlen - 1`` text tokens with
    ``bos_token_id``), the first ``max_windows`` of them."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must have shape [1, N], got {tuple(tokens.shape)}")
    if seqlen < 2:
        raise ValueError(f"seqlen must be >= 2 (one token of context, one predicted), got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    if bos_token_id is not None and tokens.shape[1] and int(tokens[0, 0]) == int(bos_token_id):
        tokens = tokens[:, 1:]  # a stream tokenized with its own leading BOS: the windows get theirs
    n = tokens.shape[1]
    step = seqlen if bos_token_id is None else seqlen - 1  # text tokens per window
    windows = n // step
    if windows < 1:
        raise ValueError(f"only {n} tokens: fewer than one window of seqlen={seqlen}")
    if max_windows is not None:
        windows = min(windows, max_windows)
    ids = tokens[0, : windows * step].to(torch.long).view(windows, step)
    if bos_token_id is not None:
        ids = torch.cat([torch.full((windows, 1), int(bos_token_id), dtype=torch.long), ids], dim=1)
    return ids


def _logits(model, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits.shape[:2] != batch.shape:
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)} for input {tuple(batch.shape)}"
        )
    return logits


def window_nll(model, batch: torch.Tensor, start: int = 0, windows: int | None = None):
    """``(summed NLL per window, float64 [b]; the scoring logits, float32 [b, seqlen - 1, vocab])`` of
    a batch of windows ``[b, seqlen]`` (positions ``1..``, each predicted from its prefix).  NaN or Inf
    raise :class:`~bitmosaic.errors.NonFiniteError` naming the window (``start``: the batch's first
    window, of ``windows``)."""
    pred = _logits(model, batch)[:, :-1, :].float()  # position t predicts token t+1
    target = batch[:, 1:]
    nll = token_nll(pred, target)
    _check_finite_windows(nll, pred, start, windows or batch.shape[0], "the model")
    return nll.sum(dim=1, dtype=torch.float64), pred


def _check_finite_windows(values: torch.Tensor, logits: torch.Tensor, start: int, windows: int, who: str):
    """A :class:`~bitmosaic.errors.NonFiniteError` naming the first window (1-based, of ``windows``)
    whose ``values`` (per-token NLL or logits, ``[batch, ...]``) hold a NaN or an Inf."""
    ok = torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
    if bool(ok.all()):
        return
    j = int((~ok).nonzero()[0, 0])
    lg = logits[j]
    nan, inf = int(torch.isnan(lg).sum()), int(torch.isinf(lg).sum())
    raise NonFiniteError(
        f"{who}'s outputs on evaluation window {start + j + 1} of {windows} are not finite ({nan} NaN and "
        f"{inf} Inf logit(s)): its activations overflow, so its perplexity is undefined; check the weights "
        "(a norm or layer scaled out of range) or evaluate in float32"
    )


def _total_nll(
    model,
    ids: torch.Tensor,
    batch_size: int,
    device: torch.device,
    progress: bool,
    reference=None,
    meter: FidelityMeter | None = None,
    sums: list[float] | None = None,
) -> float:
    """Summed NLL (float64) of windows ``ids`` ``[windows, seqlen]``, each scoring its positions 1..
    (with ``reference``, ``meter`` also gets both models' logits at those positions; ``sums``, when
    given, gets each window's summed NLL)."""
    from tqdm.auto import tqdm

    windows, seqlen = ids.shape
    total_nll = 0.0  # python float: float64 accumulation
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    ref_training = getattr(reference, "training", False)
    if reference is not None and hasattr(reference, "eval"):
        reference.eval()
    ref_device = _model_device(reference) if reference is not None else None
    try:
        with (
            torch.inference_mode(),
            tqdm(
                total=windows, desc="perplexity", unit="win", disable=not progress, dynamic_ncols=True
            ) as bar,
        ):
            for start in range(0, windows, batch_size):
                batch = ids[start : start + batch_size].to(device)
                nll, pred = window_nll(model, batch, start, windows)
                total_nll += float(nll.sum())
                if sums is not None:
                    sums.extend(nll.tolist())
                if meter is not None:
                    ref = _logits(reference, batch.to(ref_device))[:, :-1, :].to(pred.device)
                    # the full-logits scan runs only where a KL value is not finite, which any NaN or
                    # Inf in ``ref`` makes it (a scan of every window's logits was 7% of a verdict row)
                    check = partial(_check_finite_windows, ref, ref, start, windows, "the reference model")
                    meter.update(ref, pred, check)
                    del ref
                del pred, nll
                bar.update(batch.shape[0])
                if progress:
                    done = min(start + batch_size, windows) * (seqlen - 1)
                    bar.set_postfix(ppl=f"{_exp(total_nll / done):.3f}")
    finally:
        if was_training:
            model.train(True)
        if ref_training:
            reference.train(True)
    return total_nll
