"""Data-parallel calibration over ``torch.distributed``: ``torchrun --nproc-per-node N -m bitmosaic
quantize ...`` (``--nnodes`` for several machines) with the same flags as one process.

:func:`init_from_env` starts one process group when ``WORLD_SIZE`` > 1 (torchrun sets it, with
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``...): gloo on the CPU, NCCL on CUDA (rank ``r`` on
``cuda:LOCAL_RANK``).  Without it every call here is a no-op on :func:`current`'s one-process
:class:`Dist`, so a single process runs exactly the code it ran before.

**Who does what.**

- *Forward passes*: the calibration batches (``batch_size`` samples each, in order) are dealt
  round-robin, rank ``r`` taking batches ``r, r+N, r+2N, ...`` (:meth:`Dist.split`).  Each rank
  captures the layer-0 inputs of its own batches and runs only those through every layer: the
  statistics passes and the final pass that makes the next layer's inputs.  More ranks than
  batches is a one-line error.
- *Statistics* (Hessians, activation observers, the float captures a ``transform`` reads): the
  inputs of each group's linears are broadcast batch by batch in global batch order
  (:meth:`Dist.stream`), and every rank adds every batch in the order one process adds them.
  The Hessian's block rows (:class:`~bitmosaic.algorithms.hessian.HessianAccumulator` adds 128 or
  256 rows at a time) are dealt over the ranks, longest first to the least loaded
  (:meth:`Dist.hessian_blocks`); each rank computes its own and the owners broadcast them
  (:meth:`Dist.gather_hessian`).
- *Experts* (mixture-of-experts layers, :mod:`~bitmosaic.pipeline.experts`): each rank runs the
  router and the experts on its own batches; what each expert linear read of a batch (its routed rows
  and their routing weights; under ``--moe-calib all`` every token, the batch sent once for every
  expert's gate/up) is broadcast in global batch order, and every rank adds it to that expert's Hessian
  as one process does, block rows dealt over the ranks (rotated by the accumulator's index, so that
  thin experts' single block rows are spread).  The rows per expert, the experts below
  ``--moe-min-tokens`` and their pooled Hessians, and a group's parts under the memory budget (the
  least of the ranks' budgets) are one process's; the expert linears' solves are shared out as
  below.
- *Solves*: a method whose rows are quantized independently (``row_separable``) has every solve
  call split into N contiguous row blocks, one per rank; any other method's calls are owned
  whole, round-robin by a counter that runs over the whole run (call ``k`` on rank ``k mod N``).
  ``transform`` hooks (smoothing searches) are owned per group capture the same way.  Results are
  all-gathered (on the CPU, pickled), so every rank packs and writes back the same weights and
  the next layer's inputs are right on every rank.
- *Fisher salience* (a ``prepare`` step's service): rank ``r`` sums the squared gradients of
  samples ``r, r+N, ...`` in order; the sums are added in rank order and divided by the number of
  samples once.
- *Output*: only rank 0 prints, shows progress, evaluates and writes the folder and the JSON.

**Reduction order.**  Hessians and observers (activation maxima, a smoothing search's channel means, static
scales) are not summed over ranks: every element goes through the operations one process applies
to it (the running mean over the batches in global batch order; each block row by the same
``addmm``), so they are bit-identical to one process's whenever the BLAS gives the same bits for
the same product whatever the thread count and the rows around it (true here: 1 and 2 threads, 1
and 2 processes give the same codes; a split solve's rows likewise).  This matters: GPTQ with MSE
scales is chaotic in its inputs.  Summing per-rank Hessians in rank order instead (this module's
first version) differed from one process by rounding only in layer 0's q/k/v (0.01-0.09% of their
codes), but the flips grow through the sequential updates: 36% of layer 0's down_proj, 36% of
SmolLM2-135M's codes in all, perplexity +0.9% (GPTQ w4 g128, 16 x 512 tokens).  The one real sum,
Fisher's, adds the per-rank sums in rank order, ``((p_0 + p_1) + p_2) + ...``, chunk by chunk and
identically on every rank (:meth:`Dist.sum`), so it differs from one process's by rounding.  The
calibration cache (layer-0 inputs and captures) is not used under torchrun; the Fisher cache is,
when every rank finds it.

**Traffic.**  The price of exactness: each group's inputs, ``tokens x in_features`` values in the
compute dtype, reach every rank (SmolLM2-135M with 16 x 512 tokens: about 0.1 GB per layer;
an expert group: about ``k (H + I)`` values per token, ``k`` experts per token of hidden ``H`` and
width ``I``; ``H + E I`` under ``--moe-calib all``), where summing Hessians would move ``in_features²``
per linear (per expert); on one machine (shared-memory loopback, NVLink)
this is small next to the forward passes, across slow links it may not be.

**Streaming** (``quantize --stream``) is refused under torchrun in one line: its resume record
holds one process's calibration activations and random state, not one share per rank.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import OptionError

__all__ = ["Dist", "current", "init_from_env", "shutdown", "launched_world"]

_CHUNK = 1 << 24


def launched_world() -> int:
    """``WORLD_SIZE`` from the environment (1 when not launched by torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class Dist:
    """One rank of a data-parallel calibration (``world == 1``: one process, every call a no-op)."""

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | None = None) -> None:
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")  # where collectives' tensors live
        self.batches: int = 0  # calibration batches in all, set by split()
        self._calls = 0  # the run's round-robin owner counter

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owner(self, i: int) -> int:
        return i % self.world

    def next_owner(self) -> int:
        """The owner of the run's next owned unit (every rank calls this in the same order)."""
        r = self.owner(self._calls)
        self._calls += 1
        return r

    # -- samples ---------------------------------------------------------------------------------
    def split(self, calib: torch.Tensor, batch_size: int) -> torch.Tensor:
        """This rank's calibration samples: batches ``rank, rank + world, ...`` of ``calib`` cut into
        batches of ``batch_size`` (the global last batch, possibly short, stays last), so batching
        the share again with ``batch_size`` gives exactly those batches.  Resets the owner counter."""
        self._calls = 0
        self.batches = self.check_batches(calib.shape[0], batch_size)
        if self.world == 1:
            return calib
        mine = range(self.rank, self.batches, self.world)
        return torch.cat([calib[b * batch_size : (b + 1) * batch_size] for b in mine])

    def check_batches(self, samples: int, batch_size: int) -> int:
        """The number of calibration batches; a one-line error when some rank would get none."""
        batches = -(-samples // batch_size)
        if batches < self.world:
            b, p = ("batch", "process") if batches == 1 else ("batches", "processes")
            raise OptionError(
                f"{self.world} processes but only {batches} calibration {b} ({samples} samples / "
                f"--batch-size {batch_size}); use at most {batches} {p}, more --nsamples or a "
                "smaller --batch-size"
            )
        return batches

    # -- collectives -----------------------------------------------------------------------------
    def all_gather_object(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, _move(obj, torch.device("cpu")))
        return out

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the ranks, added in rank order (the same bits on every rank)."""
        if self.world == 1:
            return t
        flat = t.detach().reshape(-1).to(self.device)
        out = torch.empty_like(flat)
        for a in range(0, flat.numel(), _CHUNK):
            part = flat[a : a + _CHUNK].contiguous()
            parts = [torch.empty_like(part) for _ in range(self.world)]
            torch.distributed.all_gather(parts, part)
            acc = parts[0].clone()
            for p in parts[1:]:
                acc += p
            out[a : a + _CHUNK] = acc
        return out.reshape(t.shape).to(t.device)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        x = t.detach().clone().to(self.device)
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        return x.to(t.device)

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        if self.world == 1:
            return flag
        return bool(self.max(torch.tensor([0.0 if flag else 1.0])).item() == 0.0)

    # -- statistics ------------------------------------------------------------------------------
    def stream(self, local: int, produce: Callable[[int], list], consume: Callable[[int, list], Any]) -> None:
        """``consume(b, items)`` on every rank for every calibration batch ``b``, in batch order, where
        ``items`` (``[(key, tensor)]``) is what ``produce(j)`` returned on the rank holding ``b`` as
        its ``j``-th batch (``local``: how many this rank holds); the tensors are broadcast."""
        if self.world == 1:
            for j in range(local):
                consume(j, produce(j))
            return
        assert local == len(range(self.rank, self.batches, self.world)), "stream over this rank's share"
        for j in range(-(-self.batches // self.world)):
            items = produce(j) if j < local else None
            for r in range(self.world):
                b = j * self.world + r
                if b < self.batches:
                    consume(b, self._broadcast_items(items if r == self.rank else None, r))

    def _broadcast_items(self, items: list | None, src: int) -> list:
        """``items`` of rank ``src`` on every rank (a ``None`` tensor: the item's key alone travels)."""
        meta = [[(k, None if t is None else (tuple(t.shape), t.dtype)) for k, t in items] if items is not None
                 else None]  # fmt: skip
        torch.distributed.broadcast_object_list(meta, src=src, device=self.device)
        out = []
        for n, (k, spec) in enumerate(meta[0]):
            if spec is None:
                out.append((k, None))
                continue
            shape, dtype = spec
            if self.rank == src:
                buf = items[n][1].to(self.device).contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
            torch.distributed.broadcast(buf, src=src)
            out.append((k, items[n][1] if self.rank == src else buf))
        return out

    def hessian_blocks(self, acc, offset: int = 0) -> set[int]:
        """The block rows of ``acc`` this rank computes: longest first to the least loaded rank
        (the block row from row ``i`` costs ``rows x (n - i)``), ties to the lowest rank counted from
        ``offset`` (many small accumulators, e.g. one per expert: rotate it so that their single
        block rows do not all land on rank 0)."""
        starts = list(acc.block_starts)
        if self.world == 1:
            return set(range(len(starts)))
        me = (self.rank - offset) % self.world
        n = acc.in_features
        ends = [*starts[1:], n]
        cost = [(e - i) * (n - i) for i, e in zip(starts, ends, strict=True)]
        load = [0] * self.world
        mine = set()
        for k in sorted(range(len(starts)), key=lambda k: (-cost[k], k)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            load[r] += cost[k]
            if r == me:
                mine.add(k)
        return mine

    def gather_hessian(self, acc, mine: set[int]) -> None:
        """Every rank's block rows of ``acc`` (``mine``: this rank's), broadcast by their owners."""
        if self.world == 1:
            return
        for r, blocks in enumerate(self.all_gather_object(sorted(mine))):
            for k in blocks:
                view = acc.block_row(k)
                buf = view.contiguous().to(self.device)
                torch.distributed.broadcast(buf, src=r)
                if r != self.rank:
                    view.copy_(buf)

    # -- owned work ------------------------------------------------------------------------------
    def map_owned(self, items: Sequence, fn: Callable[[Any], Any]) -> list:
        """``[fn(item) for item in items]``, each item computed by its owner (round-robin) and the
        results gathered to every rank."""
        if self.world == 1:
            return [fn(item) for item in items]
        owners = [self.next_owner() for _ in items]
        mine = {i: fn(item) for i, item in enumerate(items) if owners[i] == self.rank}
        got: dict = {}
        for part in self.all_gather_object(mine):
            got.update(part)
        return [got[i] for i in range(len(items))]

    def solve(
        self, weights: Sequence[torch.Tensor], quantize: Callable[[int, torch.Tensor], Any], split_rows: bool
    ) -> list[tuple[Any, float]]:
        """``(quantize(i, weights[i]), seconds)`` for each solve call ``i`` of one shared Hessian.

        ``split_rows`` (row-separable methods): every call's rows are split into ``world``
        contiguous blocks, one per rank, solved there and concatenated (``cat_rows``); else each
        call is owned whole by one rank.  ``seconds``: the call's wall time (its slowest block)."""
        if self.world == 1:
            out = []
            for i, W in enumerate(weights):
                t0 = time.perf_counter()
                res = quantize(i, W)
                out.append((res, time.perf_counter() - t0))
            return out
        pieces = []  # (call, first row, end row, owner)
        for i, W in enumerate(weights):
            if split_rows:
                R = W.shape[0]
                cuts = [r * R // self.world for r in range(self.world + 1)]
                pieces += [(i, cuts[r], cuts[r + 1], r) for r in range(self.world) if cuts[r + 1] > cuts[r]]
            else:
                pieces.append((i, 0, W.shape[0], self.next_owner()))
        mine = {}
        for k, (i, a, b, r) in enumerate(pieces):
            if r == self.rank:
                t0 = time.perf_counter()
                W = weights[i][a:b] if split_rows else weights[i]
                res = quantize(i, W)
                mine[k] = (res, time.perf_counter() - t0)
        got: dict = {}
        for part in self.all_gather_object(mine):
            got.update(part)
        out = []
        for i, W in enumerate(weights):
            ks = [k for k, p in enumerate(pieces) if p[0] == i]
            parts = [got[k][0] for k in ks]
            res = parts[0] if len(parts) == 1 else type(parts[0]).cat_rows(parts)
            out.append((_move(res, W.device), max(got[k][1] for k in ks)))
        return out

    def fisher_share(self, tokens: torch.Tensor) -> torch.Tensor:
        """The calibration samples whose Fisher terms this rank sums: ``rank, rank + world, ...``."""
        return tokens[self.rank :: self.world]

    def __repr__(self) -> str:
        return f"Dist(rank={self.rank}, world={self.world}, device={self.device})"


def _move(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside it (dataclass fields, dicts, lists, tuples) on ``device``."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            m = _move(v, device)
            if m is not v:
                object.__setattr__(new, f.name, m)
        return new
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_move(v, device) for v in obj)
    return obj


_SINGLE = Dist()
_ACTIVE: Dist | None = None


def current() -> Dist:
    """The process group this process belongs to (:func:`init_from_env`, or any group already
    initialised through ``torch.distributed``), else the one-process :class:`Dist`."""
    if _ACTIVE is not None:
        return _ACTIVE
    td = torch.distributed
    if td.is_available() and td.is_initialized() and td.get_world_size() > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else None
        return Dist(td.get_rank(), td.get_world_size(), dev)
    return _SINGLE


def init_from_env(device: torch.device | None = None) -> tuple[Dist, torch.device | None]:
    """Start the process group when launched with ``WORLD_SIZE`` > 1: gloo for a CPU run, NCCL for a
    CUDA one (each rank then on ``cuda:LOCAL_RANK``); return it and the device this rank uses."""
    global _ACTIVE
    world = launched_world()
    if world == 1:
        return _SINGLE, device
    td = torch.distributed
    if not td.is_available():
        raise OptionError(f"WORLD_SIZE={world} but this torch build has no torch.distributed")
    cuda = device is not None and device.type == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise OptionError(
                f"local rank {local} but only {torch.cuda.device_count()} GPUs here; use "
                f"--nproc-per-node {torch.cuda.device_count()} or fewer"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not td.is_initialized():
        try:
            td.init_process_group(backend="nccl" if cuda else "gloo")
        except ValueError as e:  # e.g. RANK or MASTER_ADDR missing: not started by torchrun
            msg = f"WORLD_SIZE={world} but the process group cannot start ({e}); launch with torchrun"
            raise OptionError(msg) from None
    _ACTIVE = Dist(td.get_rank(), td.get_world_size(), device if cuda else None)
    return _ACTIVE, device


def shutdown() -> None:
    """End the process group :func:`init_from_env` started (no-op otherwise)."""
    global _ACTIVE
    if _ACTIVE is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _ACTIVE = None


def local_threads(world_here: int | None = None) -> int:
    """CPU threads per process when ``world_here`` processes share this machine's cores."""
    n = world_here or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(n, 1))
