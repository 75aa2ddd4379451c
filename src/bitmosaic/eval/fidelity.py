"""Cheap fidelity of a quantized model against its float reference, on the perplexity windows.

For each scored position ``t`` of a window (the same positions perplexity scores), with ``p`` the
reference's and ``q`` the quantized model's next-token distribution:

* ``KL(p || q) = Σ_v p_v (log p_v − log q_v)``, in nats, computed in float32 from the log-softmax of
  both logits (the direction lm-eval and llama.cpp's ``--kl-divergence`` use: the float model is the
  truth);
* top-1 agreement: ``argmax p == argmax q``.

:class:`FidelityMeter` accumulates them batch by batch; its summary is the mean KL, its 99th
percentile (over every scored token, ``torch.quantile``'s linear interpolation) and the top-1
agreement rate.  Nothing here holds more than one batch of logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_ELEMENTS", "token_kl", "token_nll", "FidelityMeter"]


# Rows of logits handled at once by the row-wise scores below: about 16 MB of float32, so each
# temporary stays under glibc's largest mmap threshold and is reused from the heap instead of being
# mapped and zeroed afresh (one Gemma-3-270m window's NLL and KL, [511, 262144] logits: 2.0 s chunked
# against 6.6 s in one pass, a diagnostic beside another job, not a quiet timing).  Every score is
# computed row by row, so the chunking changes no bit.
CHUNK_ELEMENTS = 1 << 22


def _row_chunks(*tensors: torch.Tensor):
    """``(offset, chunks)`` over the rows of same-shaped ``[..., V]`` tensors, at most
    :data:`CHUNK_ELEMENTS` each, without copying a strided batch (``logits[:, :-1]``) whole."""
    V = tensors[0].shape[-1]
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    views = [[t[j] for j in range(t.shape[0])] if t.dim() == 3 else [t.reshape(-1, V)] for t in tensors]
    offset = 0
    for parts in zip(*views, strict=True):
        for i in range(0, parts[0].shape[0], step):
            yield offset + i, [p[i : i + step] for p in parts]
        offset += parts[0].shape[0]


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(softmax(ref) || softmax(logits))`` over the last dim, float32, shape ``[...]``
    (computed over chunks of positions: the same values as one pass, with less memory)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"reference logits {tuple(ref_logits.shape)} and model logits {tuple(logits.shape)} differ; "
            "both models must share the tokenizer and vocabulary"
        )
    out = torch.empty(logits.shape[:-1].numel(), dtype=torch.float32, device=logits.device)
    for i, (r, q) in _row_chunks(ref_logits, logits):
        lp = F.log_softmax(r.float(), dim=-1)
        lq = F.log_softmax(q.float(), dim=-1)
        out[i : i + lq.shape[0]] = (lp.exp() * (lp - lq)).sum(-1).clamp_min_(0.0)
    return out.view(logits.shape[:-1])


def token_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position ``-log softmax(logits)[target]``, float32, shape ``target.shape`` (logits
    ``[..., V]``): ``F.cross_entropy(..., reduction="none")`` over chunks of positions, the same values."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(target.shape)}")
    out = torch.empty(target.numel(), dtype=torch.float32, device=logits.device)
    t = target.reshape(-1)
    for i, (x,) in _row_chunks(logits):
        out[i : i + x.shape[0]] = F.cross_entropy(x.float(), t[i : i + x.shape[0]], reduction="none")
    return out.view(target.shape)


class FidelityMeter:
    """Accumulates per-token KL and top-1 agreement over batches of ``[batch, positions, vocab]``."""

    def __init__(self) -> None:
        self._kl: list[torch.Tensor] = []
        self._agree = 0
        self._count = 0

    def update(
        self, ref_logits: torch.Tensor, logits: torch.Tensor, on_nonfinite: Callable[[], None] | None = None
    ) -> None:
        """Adds one batch.  ``on_nonfinite()``, where given, is called (and expected to raise) before
        anything is added when a KL value is not finite -- which every NaN or Inf in ``ref_logits``
        causes (NaN, or ``0 * inf`` for a -Inf logit), so the caller need not scan the logits first."""
        kl = token_kl(ref_logits, logits)
        if on_nonfinite is not None and not bool(torch.isfinite(kl).all()):
            on_nonfinite()
        self._kl.append(kl.reshape(-1).double().cpu())
        self._agree += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
        self._count += kl.numel()

    def state(self) -> dict:
        """What the meter holds (per-token KL, float64 on the CPU; agreement and token counts), for
        :meth:`from_state` -- e.g. to continue an evaluation in a later process."""
        kl = torch.cat(self._kl) if self._kl else torch.empty(0, dtype=torch.float64)
        return {"kl": kl, "agree": self._agree, "count": self._count}

    @classmethod
    def from_state(cls, state: dict) -> FidelityMeter:
        m = cls()
        kl = state["kl"].reshape(-1).double()
        if kl.numel() != state["count"]:
            raise ValueError(f"fidelity state holds {kl.numel()} KL values for {state['count']} tokens")
        m._kl = [kl] if kl.numel() else []
        m._agree, m._count = int(state["agree"]), int(state["count"])
        return m

    def summary(self) -> dict:
        if not self._count:
            raise ValueError("no tokens were compared")
        kl = torch.cat(self._kl)
        return {
            "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)) if kl.numel() <= 16_000_000 else _p99_sorted(kl),
            "top1_agreement": self._agree / self._count,
            "compared_tokens": self._count,
        }


def _p99_sorted(kl: torch.Tensor) -> float:
    """``torch.quantile`` refuses inputs over 16M elements: the same linear interpolation by sorting."""
    s, _ = torch.sort(kl)
    pos = 0.99 * (s.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, s.numel() - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))
