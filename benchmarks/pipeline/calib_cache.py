"""What the calibration statistics cache (``bitmosaic.pipeline.calib_cache``) saves on SmolLM2-135M.

``stages``: for each cached kind, the time to compute it, to compute and store it (a cold cache)
and to load it (a warm cache), the entry's size, and whether the loaded values equal the computed
ones bit for bit: ``inputs`` (layer 0's inputs and kwargs), ``captures`` (layer 0's float group
statistics at the SmoothQuant and AWQ token-sample sizes), ``fisher`` (``--fisher-samples``
samples); plus ``key``, the time to fingerprint the model for the run's key.
``e2e``: each ``--methods`` config quantized three times -- without a cache, with a cold one, with
the warm one (so the later methods of the list find what the earlier ones stored, as in
``bitmosaic compare``) -- with the wall time of each and a bit-for-bit check of the three models.

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.pipeline.calib_cache --threads 2
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, base_parser, write_text
from bitmosaic.data import calibration_samples
from bitmosaic.io import load_model
from bitmosaic.models.arch import get_arch
from bitmosaic.pipeline import RunSettings, quantize_model
from bitmosaic.pipeline.calib_cache import CalibCache
from bitmosaic.pipeline.calibration import LayerInputs, capture_layer_inputs, cast_floating
from bitmosaic.pipeline.capture import capture_groups
from bitmosaic.pipeline.fisher import fisher_salience
from bitmosaic.pipeline.recipe import method_config


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _size_mb(root, kind) -> float:
    return sum(p.stat().st_size for p in (root / kind).glob("*.safetensors")) / 2**20


def stages(model, calib, args, root) -> list[dict]:
    arch = get_arch(model)
    layers = arch.layers(model)
    dev, cdt, bs = torch.device("cpu"), torch.float32, args.batch_size
    cache = CalibCache(root)
    run, t_key = _timed(
        lambda: cache.bind(model, layers, calib, batch_size=bs, device=dev, compute_dtype=cdt, seed=args.seed)
    )
    rows = [{"stage": "key", "compute_s": t_key}]

    def row(stage, fn, compute, cached, kind):
        before = _size_mb(root, kind)
        want, t_c = _timed(lambda: fn(compute))
        _, t_cold = _timed(lambda: fn(cached))
        have, t_warm = _timed(lambda: fn(cached))
        rows.append({"stage": stage, "compute_s": t_c, "cold_s": t_cold, "warm_s": t_warm,
                     "entry_mb": _size_mb(root, kind) - before, "identical": _same(want, have)})  # fmt: skip
        return have

    first, kw = row(
        "inputs",
        lambda f: f(model, layers, calib, bs, dev),
        capture_layer_inputs,
        lambda *a: run.layer_inputs(*a, capture_layer_inputs),
        "inputs",
    )
    inputs = LayerInputs(first, dev, False, cdt)
    kwargs = cast_floating(next(iter(kw.values())), dev, cdt)
    layer = copy.deepcopy(layers[0]).to(cdt)
    for max_tokens in (2048, 256):  # SmoothQuant / SQ-format, AWQ / SFMP

        def cap(fn, max_tokens=max_tokens):
            gen = torch.Generator().manual_seed(args.seed)
            caps = fn(layer, arch, inputs, kwargs, max_tokens=max_tokens, generator=gen)
            return [(c.hessian, c.sample, c.observer.channel_absmax, c.observer.channel_abssum) for c in caps]

        row(f"captures@{max_tokens}", cap, capture_groups, run.group_captures, "captures")
    toks = calib[: args.fisher_samples]
    row(
        f"fisher ({len(toks)} samples)",
        lambda where: fisher_salience(model, toks, cache_dir=where, progress=False)[0],
        None,
        cache,
        "fisher",
    )
    return rows


def e2e(model, calib, args, root) -> list[dict]:
    rows = []
    for spec_text in [m.strip() for m in args.methods.split(";") if m.strip()]:
        method, _, opts = spec_text.partition(":")
        options = json.loads(opts) if opts else {}
        spec, cfg = method_config(method, options, None)
        states, row = [], {"config": spec_text}
        for label, cache in (("none", None), ("cold", CalibCache(root)), ("warm", CalibCache(root))):
            m = copy.deepcopy(model)
            settings = RunSettings(progress=False, batch_size=args.batch_size, seed=args.seed,
                                   calib_cache=cache)  # fmt: skip
            rep = quantize_model(m, calib, spec, cfg, settings)
            row[f"{label}_s"] = rep.seconds
            if cache is not None:
                row[f"{label}_hits"] = " ".join(rep.calibration["cache"]["hits"]) or "-"
            states.append(m.state_dict())
            del m
        row["identical"] = _same(states[0], states[1]) and _same(states[0], states[2])
        rows.append(row)
        print(row, flush=True)
    return rows


_METHODS = 'awq:{"bits": 4, "group_size": 128}; gptq:{"bits": 4, "group_size": 128}'


def _md(rows: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = [
        f"{r.get(c):.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for r in rows for c in cols
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i in range(len(rows)):
        lines.append("| " + " | ".join(fmt[i * len(cols) : (i + 1) * len(cols)]) + " |")
    return lines


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--fisher-samples", type=int, default=8)
    p.add_argument("--parts", default="stages,e2e")
    p.add_argument("--methods", default=_METHODS, help="';'-separated method:{json options}")
    p.add_argument("--cache-dir", default=None, help="default: a fresh temporary folder")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    calib = calibration_samples(
        tok, "wikitext2", args.nsamples, args.seqlen, args.seed, data_dir=args.data_dir
    )
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory(prefix="calib-cache-bench-") as tmp:
        root = Path(args.cache_dir or tmp)
        out = {"benchmark": "calib_cache", "args": vars(args), "threads": torch.get_num_threads()}
        md = [f"# Calibration cache on {args.model}, calib {args.nsamples}x{args.seqlen}, "
              f"{torch.get_num_threads()} threads", ""]  # fmt: skip
        if "stages" in parts:
            out["stages"] = stages(model, calib, args, root)
            md += ["## Per kind (seconds; cold = compute + store, warm = load)", "", *_md(out["stages"]), ""]
        if "e2e" in parts:
            out["e2e"] = e2e(model, calib, args, root / "e2e")  # its own cache: cold means cold
            md += ["## quantize_model wall time (seconds)", "", *_md(out["e2e"]), ""]
    print("\n".join(md))
    path = Path(args.json) if args.json else RESULTS / "calib_cache.json"
    write_text(path, json.dumps(out, indent=2))
    write_text(path.with_suffix(".md"), "\n".join(md) + "\n")
    print(f"JSON written to {path}")


if __name__ == "__main__":
    main()
