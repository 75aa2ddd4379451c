"""GGUF export measured in llama.cpp: does llama.cpp compute the same perplexity on our exported file as
bitmosaic does on the saved model, and is a bitmosaic GPTQ-calibrated file better than llama.cpp's own
quantization of the same float model at the same GGUF type?

Protocol *fast* (default): calibration 16 x 512 tokens of WikiText-2 ``valid`` (seed 0), perplexity on
the first 20 non-overlapping 512-token windows of WikiText-2 raw ``test`` (``bitmosaic.eval.perplexity``'s
windows: BOS + 511 text tokens when the tokenizer adds a BOS).  llama.cpp (``llama_cpp`` built from
source, CPU: the installed package, or the one ``benchmarks/peers/peer_llama.py`` builds once into a cache
folder where none is) gets the very same token ids, one window per fresh context
(``logits_all=True``), and its logits are scored in float64 like bitmosaic's.

Rows:

- ``bitmosaic GPTQ`` (act-order, static groups, MSE scales, group 32): bitmosaic's perplexity of the saved
  model; ``llama.cpp on our export``: llama.cpp's perplexity of ``bitmosaic export --format gguf`` of it
  (exact types: Q4_0 symmetric 4-bit, Q8_0 symmetric 8-bit, and for asymmetric 4-bit the default exact
  file and ``--gguf-type Q4_1 --lossy``);
- k-quants (``--gguf-type Q*_K --lossy``: our integers kept, their sub-block scales refitted): one GPTQ run
  per type, *in llama.cpp's layout of that type*.  A k-quant super-block is 256 columns, so SmolLM2's
  layers of 576 input columns (all but ``down_proj``, 180 of 210) cannot be k-quants; llama.cpp's quantizer
  puts them in a legacy fallback type (Q4_0 for Q2_K/Q3_K, Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K).
  Our run quantizes those layers at the fallback's width (a recipe: GPTQ w4 sym for Q4_0, w5 sym for Q5_0,
  w8 sym for Q8_0) and ``down_proj`` at the k-quant's (w2 asym, w3 sym, w4 asym, w5 asym, w6 sym), so both
  files hold the same types tensor for tensor (``KQUANT_LAYOUTS``), except Q5_K, where ours keeps those
  180 layers in Q5_0 (smaller than llama.cpp's Q5_1; see ``KQUANT_LAYOUTS``).  Q4_K, Q5_K, Q6_K by
  default; ``--kquants all`` adds Q3_K and Q2_K;
- ``llama.cpp quantize``: the float SmolLM2 exported as an F32 GGUF (exact), quantized with
  ``llama_cpp.llama_model_quantize`` to the same type; its token embedding (SmolLM2 ties it to the output)
  kept at Q8_0 as in our files (``token_embedding_type``/``output_tensor_type``), so that only the linear
  layers differ.  k-quants with ``pure`` (every tensor the type where it can be, not the ``_S``/``_M``
  mixes).  The Python binding exposes ``imatrix`` only as a raw pointer to llama.cpp's C++ map and no way
  to compute one, so importance-matrix quantization is not measured.

Every step keeps its output under ``--work`` (default ``runs/gguf_export``) and is skipped when it is
there, so an interrupted run continues.  Reproduce::

    flock /tmp/bitmosaic-heavy.lock python -m benchmarks.peers.gguf_export --threads 2

Note: SmolLM2-135M's GGUF stores its linear layers as Q4_1 (asymmetric 4-bit, groups of 32), so every
4-bit group-32 quantization of it is close to lossless and the differences at 4 and 8 bits are small.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import RESULTS, machine_info, write_results  # noqa: E402

CONFIGS = {  # name -> (GPTQ options, [(file tag, --gguf-type, lossy)])
    "w4 sym g32": ({"bits": 4, "sym": True}, [("Q4_0", None, False)]),
    "w4 asym g32": ({"bits": 4, "sym": False}, [("exact", None, False), ("Q4_1", "Q4_1", True)]),
    "w8 sym g32": ({"bits": 8, "sym": True}, [("Q8_0", None, False)]),
    # 3- and 2-bit integers have no GGUF type of their own outside k-quants: a wider one holds them exactly
    "w3 sym g32": ({"bits": 3, "sym": True}, [("exact", None, False)]),
    "w2 asym g32": ({"bits": 2, "sym": False}, [("exact", None, False)]),
}
# k-quant rows: the same layout as llama.cpp's own file of that type.  Only layers whose input width is
# a multiple of 256 can be k-quants (SmolLM2: down_proj); llama.cpp's quantizer puts every other layer
# in a legacy fallback type, so ours does too, at that type's own width -- GPTQ at those bits -- and the
# two files hold the same types tensor for tensor.  type -> ((down_proj bits, sym), (others: bits, sym)).
KQUANT_LAYOUTS = {
    "Q2_K": ((2, False), (4, True)),  # llama.cpp falls back to Q4_0
    "Q3_K": ((3, True), (4, True)),  # Q4_0
    "Q4_K": ((4, False), (5, True)),  # Q5_0
    # llama.cpp falls back to Q5_1; an asymmetric 5-bit GPTQ layer is exact in Q5_1 only where every
    # block's offset is an fp16 number (else Q8_0, a larger file), so ours uses Q5_0: a smaller type
    # than llama.cpp's in those 180 layers (a handicap for ours, said in the table)
    "Q5_K": ((5, False), (5, True)),
    "Q6_K": ((6, True), (8, True)),  # Q8_0
}
KQUANT_SETS = {"4": ("Q4_K", "Q5_K", "Q6_K"), "all": tuple(KQUANT_LAYOUTS)}


def kquant_configs(which: str) -> dict:
    out = {}
    for typ in KQUANT_SETS[which]:
        (kb, ks), (fb, fs) = KQUANT_LAYOUTS[typ]
        name = f"{typ} layout: down w{kb} {'sym' if ks else 'asym'}, rest w{fb} {'sym' if fs else 'asym'}"
        out[name] = ({"bits": fb, "sym": fs, "overrides": {"bits": kb, "sym": ks}}, [(typ, typ, True)])
    return out


LLAMA_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
K_FTYPES = {"Q2_K": "Q2_K", "Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "Q6_K": "Q6_K"}


def _windows(ids: torch.Tensor, seqlen: int, max_windows: int, bos: int | None) -> list[list[int]]:
    """The windows :func:`bitmosaic.eval.perplexity` scores (its module doc), as token id lists."""
    t = ids[0]
    if bos is not None and len(t) and int(t[0]) == bos:
        t = t[1:]
    step = seqlen if bos is None else seqlen - 1
    n = min(len(t) // step, max_windows)
    out = t[: n * step].view(n, step).tolist()
    return [[bos, *w] for w in out] if bos is not None else out


def llama_cpp_ppl(path: Path, windows: list[list[int]], threads: int) -> dict:
    """llama.cpp's perplexity of the GGUF ``path`` on ``windows`` (each in a fresh context)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(windows[0]),
        n_batch=len(windows[0]),
        logits_all=True,
        n_threads=threads,
        verbose=False,
    )
    nll, count = 0.0, 0
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w)], dtype=np.float64)
        m = logits.max(-1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
        count += len(w) - 1
    del llm
    return {"ppl": math.exp(nll / count), "tokens": count}


def llama_quantize(src: Path, dst: Path, typ: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{K_FTYPES.get(typ, typ)}")
    params.pure = typ in K_FTYPES  # the k-quant on every tensor that can hold it (no _S/_M mix)
    params.nthread = threads
    params.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0
    params.output_tensor_type = llama_cpp.GGML_TYPE_Q8_0
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {typ} failed with {rc}")
    tmp.rename(dst)


def file_types(path: Path) -> dict[str, int]:
    """How many 2-D tensors of each GGUF type the file holds."""
    from gguf import GGUFReader

    out: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) == 2:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="runs/gguf_export")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--kquants",
        choices=("4", "all"),
        default="4",
        help="4: Q4_K, Q5_K and Q6_K rows; all: also Q3_K and Q2_K (one GPTQ run per k-quant type)",
    )
    p.add_argument("--no-build-peer", action="store_true",
                   help="where llama_cpp is not installed, stop instead of building it once into a cache "
                   "folder (benchmarks/peers/peer_llama.py)")  # fmt: skip
    a = p.parse_args()
    from benchmarks.peers.peer_llama import find_or_build

    peer = find_or_build(build=not a.no_build_peer)  # llama.cpp runs in this process: its folder first
    if peer is None:
        raise SystemExit(2)  # find_or_build said why, in one line
    if peer:
        sys.path.insert(0, peer)
    CONFIGS.update(kquant_configs(a.kquants))
    llama_types = LLAMA_TYPES + tuple(t for t in KQUANT_SETS[a.kquants] if t not in LLAMA_TYPES)
    torch.set_num_threads(a.threads)

    import bitmosaic
    from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
    from bitmosaic.eval.perplexity import perplexity
    from bitmosaic.io import load_model, save_quantized
    from bitmosaic.io.export import export_model
    from bitmosaic.io.saved.save import quantized_modules

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}

    def save_state():
        state_path.write_text(json.dumps(state, indent=2))

    model, tok = load_model(a.model)
    bos = bos_token_id(tok)
    ids = eval_tokens(tok, "wikitext2")
    windows = _windows(ids, a.seqlen, a.max_windows, bos)

    def ours(m) -> float:
        return perplexity(m, ids, a.seqlen, max_windows=a.max_windows, progress=False, bos_token_id=bos)[
            "ppl"
        ]

    if "float" not in state:
        state["float"] = {"bitmosaic_ppl": ours(model)}
        save_state()
    calib = calibration_samples(tok, "wikitext2", a.nsamples, a.seqlen, a.seed)
    for name, (opts, exports) in CONFIGS.items():
        folder = work / name.replace(" ", "_")
        row = state.setdefault(name, {})
        if "bitmosaic_ppl" not in row:
            import copy

            m = copy.deepcopy(model)
            t = time.perf_counter()
            opts = dict(opts)
            down = opts.pop("overrides", None)
            settings = {"group_size": 32, "order": "act", "static_groups": True, "scale": "mse", **opts}
            recipe = {"method": "gptq", "settings": settings}
            if down:  # a k-quant layout: down_proj at the k-quant's width (KQUANT_LAYOUTS)
                recipe["overrides"] = [{"match": r"mlp\.down_proj$", "settings": {**settings, **down}}]
            bitmosaic.quantize_(m, recipe, calib, progress=False, source_model=a.model)
            row["quant_seconds"] = time.perf_counter() - t
            if folder.exists():
                import shutil

                shutil.rmtree(folder)  # an interrupted earlier save: the step runs again
            save_quantized(m, folder)
            row["blocks_of_32"] = (
                sum(q.in_features * q.out_features for q in quantized_modules(m).values()) // 32
            )
            row["bitmosaic_ppl"] = ours(m)
            del m
            save_state()
        for tag, typ, lossy in exports:
            gg = work / f"{folder.name}.{tag}.gguf"
            key = f"export {tag}"
            if key not in row:
                res = export_model(folder, gg, "gguf", gguf_type=typ, lossy=lossy, overwrite=True)
                rounded = [
                    int(c.split(" in ")[1].split()[0])
                    for r in res.records
                    for c in r.changes
                    if "m rounded" in c
                ]
                row[key] = {
                    "k_layers": [
                        r.rel_err for r in res.records if any(c.startswith(f"{typ}:") for c in r.changes)
                    ]
                    if typ and typ.endswith("_K")
                    else [],
                    "file": gg.name,
                    "m_rounded_blocks": sum(rounded),
                    "types": file_types(gg),
                    "summary": res.summary(),
                    "notes": res.notes,
                    "mb": gg.stat().st_size / 2**20,
                }
                save_state()
    f32 = work / "float.F32.gguf"
    if not f32.exists():
        export_model(a.model, f32, "gguf", gguf_type="F32")
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
        print("llama_cpp is not installed (pip install llama-cpp-python, or the 'peers' extra): stopping")
    if have_llama:
        for typ in llama_types:
            dst = work / f"float.llama-quantize.{typ}.gguf"
            if not dst.exists():
                llama_quantize(f32, dst, typ, a.threads)
        runs = {
            "float F32": f32,
            **{f"llama.cpp {t}": work / f"float.llama-quantize.{t}.gguf" for t in llama_types},
        }
        for name, (_, exports) in CONFIGS.items():
            for tag, _, _ in exports:
                runs[f"{name} {tag}"] = work / state[name][f"export {tag}"]["file"]
        lp = state.setdefault("llama_cpp_ppl", {})
        for key, path in runs.items():
            if key not in lp:
                t = time.perf_counter()
                lp[key] = {
                    **llama_cpp_ppl(path, windows, a.threads),
                    "types": file_types(path),
                    "mb": path.stat().st_size / 2**20,
                    "seconds": time.perf_counter() - t,
                }
                save_state()
                print(f"  llama.cpp {key}: ppl {lp[key]['ppl']:.4f}", flush=True)
    _report(a, state, have_llama)


def _report(a, state: dict, have_llama: bool) -> None:
    lp = state.get("llama_cpp_ppl", {})
    proto = (
        f"fast protocol: calibration {a.nsamples}x{a.seqlen} WikiText-2 valid (seed {a.seed}), perplexity "
        f"on the first {a.max_windows} windows of {a.seqlen} tokens of WikiText-2 raw test"
    )
    lines = [
        f"# GGUF export in llama.cpp ({a.model}; {proto})",
        "",
        "Reproduce: `flock /tmp/bitmosaic-heavy.lock python -m benchmarks.peers.gguf_export --threads 2`",
        "",
        "## llama.cpp reads our export: its perplexity vs bitmosaic's on the same windows",
        "",
        "| model | GGUF file (2-D tensor types) | MB | weight error vs bitmosaic | bitmosaic ppl "
        "| llama.cpp ppl | llama.cpp / bitmosaic |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    fl = state["float"]["bitmosaic_ppl"]
    if "float F32" in lp:
        r = lp["float F32"]
        lines.append(
            f"| float | F32 ({_types(r['types'])}) | {r['mb']:.0f} | exact | {fl:.4f} | {r['ppl']:.4f} | "
            f"{r['ppl'] / fl:.5f} |"
        )
    for name, (_, exports) in CONFIGS.items():
        row = state[name]
        for tag, _, _ in exports:
            e = row[f"export {tag}"]
            err = (
                "exact"
                if not e["summary"]["changed_layers"]
                else f"rel {e['summary']['max_rel_err']:.1e} (max)"
            )
            r = lp.get(f"{name} {tag}")
            llp = f"{r['ppl']:.4f} | {r['ppl'] / row['bitmosaic_ppl']:.5f}" if r else "not run | -"
            lines.append(
                f"| GPTQ {name} | {_types(e['types'])} | {e['mb']:.0f} | {err} | {row['bitmosaic_ppl']:.4f} "
                f"| {llp} |"
            )
    lines += [
        "",
        "## Same GGUF type: bitmosaic GPTQ-calibrated vs llama.cpp's own quantization (llama.cpp ppl)",
        "",
        "| GGUF type | bitmosaic GPTQ file | llama.cpp quantize (same float model) | bitmosaic / llama.cpp |",
        "|---|---:|---:|---:|",
    ]
    pairs = {"Q4_0": "w4 sym g32 Q4_0", "Q4_1": "w4 asym g32 Q4_1", "Q8_0": "w8 sym g32 Q8_0"}
    for typ, ours_key in pairs.items():
        o, t = lp.get(ours_key), lp.get(f"llama.cpp {typ}")
        if o and t:
            lines.append(f"| {typ} | {o['ppl']:.4f} | {t['ppl']:.4f} | {o['ppl'] / t['ppl']:.4f} |")
    kpairs = [(typ, name) for name, (_, ex) in CONFIGS.items() for typ, _, _ in ex if typ.endswith("_K")]
    if any(lp.get(f"{name} {typ}") for typ, name in kpairs):
        lines += [
            "",
            "## k-quants: bitmosaic GPTQ refitted (--lossy) vs llama.cpp's own quantization (llama.cpp ppl)",
            "",
            "Only layers with a multiple of 256 input columns can be k-quants (SmolLM2: the 30 `down_proj`); "
            "llama.cpp puts the other 180 in a legacy fallback type, and so does ours: each row's GPTQ run "
            "quantizes down_proj at the k-quant's width and the other layers at the fallback type's width "
            "(`KQUANT_LAYOUTS`), so both files hold the same types tensor for tensor (except Q5_K: ours "
            "keeps the 180 in Q5_0, smaller than llama.cpp's Q5_1).  20 windows do not decide "
            "differences under about 1% (the exact exports above differ from bitmosaic's own perplexity "
            "by up to 0.4%).",
            "",
            "| GGUF type | bitmosaic GPTQ | its file (2-D types) | MB | weight error the refit adds "
            "(k-quant layers: mean / max rel) | ppl | llama.cpp quantize file | MB | ppl "
            "| bitmosaic / llama.cpp |",
            "|---|---|---|---:|---:|---:|---|---:|---:|---:|",
        ]
        for typ, name in kpairs:
            o, t = lp.get(f"{name} {typ}"), lp.get(f"llama.cpp {typ}")
            if not (o and t):
                continue
            errs = state[name][f"export {typ}"].get("k_layers", [])
            err = f"{np.mean(errs):.1e} / {max(errs):.1e}" if errs else "-"
            lines.append(
                f"| {typ} | {name} | {_types(o['types'])} | {o['mb']:.0f} | {err} | {o['ppl']:.4f} "
                f"| {_types(t['types'])} | {t['mb']:.0f} | {t['ppl']:.4f} | {o['ppl'] / t['ppl']:.4f} |"
            )
    if not have_llama:
        lines += ["", "llama.cpp rows not run: llama_cpp is not installed."]
    lines += [
        "",
        "Float model (bitmosaic, same windows): " + f"{fl:.4f}.  Not measured: llama.cpp with an importance "
        "matrix (not exposed by the Python binding)"
        + ("." if a.kquants == "all" else "; Q3_K and Q2_K (`--kquants all`)."),
    ]
    if a.model == "smollm2-135m":
        lines += [
            "",
            "Q4_1 on SmolLM2 says nothing about calibration: the float model *is* a dequantized Q4_1 file "
            "(its GGUF stores the linear layers as Q4_1, groups of 32), so llama.cpp's Q4_1 re-quantization "
            "lands back on the source grid (35.14 vs float 34.97), which no calibrated method that moves "
            "weights can match.  Q4_0 (a grid the source is not on) is the comparison that counts here.",
        ]
    out = {"protocol": proto, "args": vars(a), "state": state, "machine": machine_info(llama_cpp=have_llama)}
    write_results(a.json or RESULTS / "gguf_export.json", "gguf_export", out, "\n".join(lines))


def _types(t: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in t.items())


if __name__ == "__main__":
    main()
