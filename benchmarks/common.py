"""Shared harness for the benchmarks: load SmolLM2-135M once, run quantization configs on fresh
copies of the float model, measure perplexity, print a table and write JSON (atomically)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
from bitmosaic.eval.perplexity import perplexity
from bitmosaic.io import load_model
from bitmosaic.io.serialization import atomic_write_text
from bitmosaic.methods import get_method
from bitmosaic.pipeline import quantize_model
from bitmosaic.pipeline.pipeline import peak_rss_mb

RESULTS = Path(__file__).resolve().parent / "results"


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="output JSON (default benchmarks/results/<name>.json)")
    return p


class Bench:
    def __init__(self, args):
        if args.threads:
            torch.set_num_threads(args.threads)
        self.args = args
        self.model, self.tok = load_model(args.model)
        self.calib = calibration_samples(
            self.tok, "wikitext2", args.nsamples, args.seqlen, args.seed, data_dir=args.data_dir
        )
        self.eval_ids = eval_tokens(self.tok, "wikitext2", data_dir=args.data_dir)
        self.rows: list[dict] = []

    def ppl(self, model) -> float:
        r = perplexity(
            model,
            self.eval_ids,
            self.args.seqlen,
            max_windows=self.args.max_windows,
            progress=False,
            bos_token_id=bos_token_id(self.tok),
        )
        return r["ppl"]

    def float_row(self) -> dict:
        t = time.perf_counter()
        row = {"name": "float", "method": "float", "bits_per_weight": 32.0, "ppl": self.ppl(self.model)}
        row["eval_seconds"] = time.perf_counter() - t
        return self._add(row)

    def run(self, name: str, method: str, **options) -> dict:
        spec = get_method(method)
        cfg = spec.make_config(**options)
        model = copy.deepcopy(self.model)
        rep = quantize_model(model, self.calib, spec, cfg, progress=False, measure_errors=True)
        t = time.perf_counter()
        row = {
            "name": name,
            "method": method,
            "options": cfg.to_dict(),
            "bits_per_weight": rep.bits_per_weight,
            "quant_seconds": rep.seconds,
            "hessian_error": sum(r["hessian_error"] for r in rep.layers),
            "babai_bound": sum(r["babai_bound"] for r in rep.layers)
            if rep.layers[0]["babai_bound"]
            else None,
            "mean_rel_out_error": sum(r["rel_out_error"] for r in rep.layers) / len(rep.layers),
            "ppl": self.ppl(model),
        }
        row["eval_seconds"] = time.perf_counter() - t
        row["layers"] = rep.layers
        del model
        return self._add(row)

    def _add(self, row: dict) -> dict:
        self.rows.append(row)
        if getattr(self, "partial_path", None):  # keep what is done if a long run is interrupted
            rows = [{k: v for k, v in r.items() if k != "layers"} for r in self.rows]
            atomic_write_text(self.partial_path, json.dumps({"partial": True, "rows": rows}, indent=2))
        ppl = row["ppl"]
        print(
            f"  {row['name']:<34} ppl {ppl:9.3f}  bpw {row['bits_per_weight']:6.3f}"
            + (f"  quant {row['quant_seconds']:6.1f}s" if "quant_seconds" in row else ""),
            flush=True,
        )
        return row

    def finish(self, name: str, columns: list[str], extra: dict | None = None) -> None:
        a = self.args
        print(
            f"\n{name}: {a.model}, calib {a.nsamples}x{a.seqlen} (seed {a.seed}), "
            f"eval wikitext2 first {a.max_windows}x{a.seqlen}"
        )
        widths = [max(12, len(c) + 2) for c in columns]
        header = f"{'config':<34}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
        print(header)
        print("-" * len(header))
        for r in self.rows:
            cells = []
            for c, w in zip(columns, widths, strict=True):
                v = r.get(c)
                cells.append(f"{v:>{w}.4g}" if isinstance(v, float) else f"{str(v):>{w}}")
            print(f"{r['name']:<34}" + "".join(cells))
        out = {
            "benchmark": name,
            "args": vars(a),
            "machine": {
                "platform": platform.platform(),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
            },
            "peak_rss_mb": peak_rss_mb(),
            "rows": self.rows,
            **(extra or {}),
        }
        path = Path(a.json) if a.json else RESULTS / f"{name}.json"
        atomic_write_text(path, json.dumps(out, indent=2))
        print(f"\nJSON written to {path}")
