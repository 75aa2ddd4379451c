"""Data-parallel calibration over ``torch.distributed``: ``torchrun --nproc-per-node N -m bitmosaic
quantize ...`` (``--nnodes`` for several machines) with the same flags as one process.

:func:`init_from_env` starts one process group when ``WORLD_SIZE`` > 1 (torchrun sets it, with
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``...): gloo on the CPU, NCCL on CUDA (rank ``r`` on
``cuda:LOCAL_RANK``).  Without it every call here is a no-op on :func:`current`'s one-process
:class:`Dist`, so a single process runs exactly the code it ran before.

**Who does what.**

- *Samples*: the calibration batches (``batch_size`` samples each, in order) are dealt
  round-robin, rank ``r`` taking batches ``r, r+N, r+2N, ...`` (:meth:`Dist.split`).  Each rank
  captures the layer-0 inputs of its own batches and runs only those through every layer: the
  statistics passes and the final pass that makes the next layer's inputs.  More ranks than
  batches is a one-line error.
- *Statistics* (Hessians, activation observers, the float captures a ``transform`` reads, Fisher
  sums) are reduced so that every rank holds bitwise the same values (below).
- *Solves*: a method whose rows are quantized independently (``row_separable``) has every solve
  call split into N contiguous row blocks, one per rank; any other method's calls are owned
  whole, round-robin by a counter that runs over the whole run (call ``k`` of the run on rank
  ``k mod N``).  ``transform`` hooks (smoothing searches) are owned per group capture the same
  way.  Results are all-gathered (on the CPU, pickled), so every rank packs and writes back the
  same weights and the next layer's inputs are right on every rank.
- *Output*: only rank 0 prints, shows progress, evaluates and writes the folder and the JSON.

**Reduction order.**  Sums are all-gathered and added in rank order, ``((p_0 + p_1) + p_2) + ...``,
chunk by chunk (16 Mi elements), identically on every rank (no ring-allreduce chunk order).
``p_r`` is rank ``r``'s own sum over its batches in batch order.

- Hessian: ``p_r = (n_r / 2) H_r`` (the un-normalised upper triangle of ``Σ x xᵀ`` in the Hessian
  dtype, ``n_r`` its tokens); ``H = 2/n · Σ_r p_r`` once.  One process keeps a running mean over
  all batches instead, so the two differ by rounding only.
- Observers: ``max|x|`` and static-scale group maxima by all-reduce MAX (exact); ``Σ|x|`` and
  ``Σ x`` (float64), token and batch counts and percentile sums by the rank-order sum.
- Transform captures: as above for their Hessian and observer.  Their token sample is exact:
  each rank draws the very random rows one process draws for its batches (the sample generator
  is advanced over the other ranks' batches), and the rows are gathered in global batch order.
- Fisher salience: rank ``r`` sums the squared gradients of samples ``r, r+N, ...`` in order, the
  sums are added in rank order and divided by the number of samples once.

Results therefore equal one process's up to the rounding of these sums; a GPTQ code can flip where
a weight sits within rounding of a grid midpoint, and the flip moves later columns and layers a
little (tested: >= 99.9% identical codes).  The calibration cache (layer-0 inputs and captures) is
not used under torchrun; the Fisher cache is, when every rank finds the entry.
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
        self._tokens: list[int] = []  # tokens of every calibration batch, set by split()

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
        n, seqlen = calib.shape[0], calib.shape[1]
        self.batches = -(-n // batch_size)
        self._tokens = [min(batch_size, n - b * batch_size) * seqlen for b in range(self.batches)]
        if self.world == 1:
            return calib
        if self.batches < self.world:
            raise OptionError(
                f"{self.world} processes but only {self.batches} calibration batches "
                f"({calib.shape[0]} samples / --batch-size {batch_size}); use at most {self.batches} "
                "processes, more --nsamples or a smaller --batch-size"
            )
        mine = range(self.rank, self.batches, self.world)
        return torch.cat([calib[b * batch_size : (b + 1) * batch_size] for b in mine])

    def skipped_tokens(self, j: int | None) -> list[int]:
        """Token counts of the other ranks' batches between this rank's batch ``j - 1`` and its
        batch ``j`` (``j=None``: after its last batch), in batch order."""
        if self.world == 1:
            return []
        mine = range(self.rank, self.batches, self.world)
        prev = mine[j - 1] if j else (mine[-1] if j is None else -1)
        stop = self.batches if j is None else mine[j]
        return [self._tokens[b] for b in range(prev + 1, stop)]

    def in_batch_order(self, local: list) -> list:
        """Per-batch items of every rank (``local``: this rank's, in its batch order), gathered and
        put in global batch order."""
        if self.world == 1:
            return local
        every = self.all_gather_object(local)
        return [every[b % self.world][b // self.world] for b in range(self.batches)]

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

    def count(self, n: int | float) -> float:
        return float(self.sum(torch.tensor([float(n)], dtype=torch.float64)).item())

    # -- statistics ------------------------------------------------------------------------------
    def reduce_hessian(self, acc) -> None:
        """Make a :class:`~bitmosaic.algorithms.hessian.HessianAccumulator` hold every rank's tokens."""
        if self.world == 1:
            return
        upper, n = acc.raw_sum()
        acc.set_sum(self.sum(upper), int(self.count(n)))

    def reduce_observer(self, obs) -> None:
        """Make an :class:`~bitmosaic.algorithms.observers.ActObserver` hold every rank's tokens."""
        if self.world == 1:
            return
        obs.tokens = int(self.count(obs.tokens))
        obs.batches = int(self.count(obs.batches))
        obs.channel_absmax = self.max(obs.channel_absmax)
        obs.channel_abssum = self.sum(obs.channel_abssum)
        obs.channel_sum = self.sum(obs.channel_sum)
        if obs.group_amax is not None:
            obs.group_amax = self.max(obs.group_amax)
        if obs.pct_sum is not None:
            obs.pct_sum = self.sum(obs.pct_sum)

    def reduce_statistics(self, accs: dict, observers: dict) -> None:
        """The Hessians and observers of one group (:func:`group_statistics`), over every rank."""
        for name in sorted(accs):
            self.reduce_hessian(accs[name])
        for name in sorted(observers):
            self.reduce_observer(observers[name])

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
