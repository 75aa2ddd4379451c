"""Calibration-pipeline time and memory on SmolLM2-135M: GPTQ w4 g128, 16 x 512 calibration
(the shared README's llm-compressor protocol: 114 s wall, 1.36 GB peak RSS on a quiet 2-core machine),
with and without the per-layer output cache.  Run on a quiet machine:

    python benchmarks/speed.py        (writes benchmarks/results/speed.json)
"""

from __future__ import annotations

import copy
import json
import time

import torch

from bitmosaic.data import calibration_samples
from bitmosaic.methods import get_method
from bitmosaic.models import load_model, quantize_model
from bitmosaic.models.pipeline import peak_rss_mb
from bitmosaic.models.serialization import atomic_write_text

from common import RESULTS, base_parser

LLM_COMPRESSOR = {"seconds": 114.0, "peak_rss_mb": 1.36 * 1024}


def main() -> None:
    p = base_parser(__doc__)
    p.set_defaults(nsamples=16)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t = time.perf_counter()
    model, tok = load_model(a.model)
    load_s, load_rss = time.perf_counter() - t, peak_rss_mb()
    calib = calibration_samples(tok, "wikitext2", a.nsamples, a.seqlen, a.seed, data_dir=a.data_dir)
    spec = get_method("gptq")
    rows = []
    for cache in (False, True):
        m = copy.deepcopy(model)
        rep = quantize_model(
            m, calib, spec, spec.make_config(bits=4, group_size=128), progress=False, cache_outputs=cache
        )
        rows.append(
            {
                "output_cache": cache,
                "seconds": rep.seconds,
                "ratio_vs_llm_compressor": rep.seconds / LLM_COMPRESSOR["seconds"],
            }
        )
        del m
    print(f"load {load_s:.1f}s (peak RSS after load {load_rss:.0f} MB); threads {torch.get_num_threads()}")
    print(f"{'output cache':>12} {'seconds':>9} {'vs llm-compressor 114 s':>24}")
    for r in rows:
        print(f"{str(r['output_cache']):>12} {r['seconds']:>9.1f} {r['ratio_vs_llm_compressor']:>23.2f}x")
    print("peak RSS includes a deep copy of the float model per run; see the CHANGELOG for single-run RSS")
    out = {
        "benchmark": "speed",
        "args": vars(a),
        "load_seconds": load_s,
        "peak_rss_after_load_mb": load_rss,
        "rows": rows,
        "llm_compressor_reference": LLM_COMPRESSOR,
        "threads": torch.get_num_threads(),
    }
    atomic_write_text(RESULTS / "speed.json", json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
