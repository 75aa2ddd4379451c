"""The report of ``benchmarks/gguf/llamacpp_peers.py`` (the GGUF table of issue 72): its rows, cells and
notes from the run's state, and the constants both share."""

from __future__ import annotations

TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ2_XS",
         "IQ3_XXS", "IQ2_XXS", "IQ2_S", "IQ2_M")  # fmt: skip
# the presets bitmosaic solves on (gptq --gguf-type), most asked first
BPW = "bpw@"  # bitmosaic --gguf-target-bpw at the bits per weight of the preset named after it
OURS = ("Q4_K_M", "Q3_K_M", "IQ4_XS", "Q2_K", "Q5_K_M", "Q6_K", "IQ4_NL", "Q4_0", "IQ3_S", "IQ2_XS",
        "bpw@Q4_K_M", "bpw@Q3_K_M", "IQ3_XXS", "IQ2_XXS", "IQ2_S", "IQ2_M")  # fmt: skip
FRESH = 110  # seconds into a run after which a (minutes-long) bitmosaic quantization waits for the next run
CHUNKS, CTX, CALIB_CHUNKS = 40, 512, 16


def _cell(r: dict | None) -> str:
    if not r:
        return "-"
    if "kld" not in r:  # the base of the KL pass itself
        return f"{r['ppl']:.2f} ({r['mb']:.1f} MB; the KL base)"
    return f"{r['ppl']:.2f} ({r['mb']:.1f} MB, KL {r['kld']:.4f}, top-1 {r.get('top1', 0):.1f}%)"


def _speed(dec: dict, key: str) -> str:
    r = dec.get(key)
    return f"{r['tok_s']:.1f}" if r and "tok_s" in r else "-"


def _decode_note(dec: dict) -> list[str]:
    if not dec:
        return ["Not measured: decode tok/s (run `--decode`)."]
    loads = [r["load"] for r in dec.values() if isinstance(r, dict) and "load" in r]
    busy = max([dec["load_before"], *loads]) > 2.5
    return [
        "decode tok/s: each file in llama.cpp's binding (built from the same llama-cpp-python 0.3.36 source "
        "and CMake options as the tools; `benchmarks/gguf/decode_speed.py`, `llama-bench -p 0 -n 32 -t 2` "
        "emulated: BOS-only prompt, 32 greedy tokens, 5 repeats (fewer past 20 s) after a warm-up, mean "
        "rate of the decode steps), all files in one step under the heavy lock (`--decode`); 1-minute load "
        "average "
        f"{dec['load_before']:.2f} before, {min(loads, default=0):.2f}-{max(loads, default=0):.2f} "
        "while timing"
        + (
            ": taken beside other work on the 2 cores (load > 2.5), where llama.cpp's spinning threads "
            "slow down by up to two orders of magnitude: these speeds do not rank the types; rerun "
            "`--decode` on a quiet machine."
            if busy
            else "."
        )
    ]


def _vs(ours: dict | None, imat: dict | None) -> str:
    """``ppl ratio [paired 95% interval over the chunks], MB ratio``; *within noise* where the interval
    holds 1 (issue 73's rule for close pairs)."""
    if not (ours and imat):
        return "-"
    cell = f"{ours['ppl'] / imat['ppl']:.4f}x ppl"
    a, b = ours.get("chunk_nll"), imat.get("chunk_nll")
    if a and b and len(a) == len(b):
        from bitmosaic.eval.bootstrap import bootstrap_ratio

        lo, hi = bootstrap_ratio(a, b)
        cell += f" [{lo:.3f}, {hi:.3f}]" + (" within noise" if lo <= 1 <= hi else "")
    return f"{cell}, {ours['mb'] / imat['mb']:.3f}x MB"


def _kept_note(st: dict) -> list[str]:
    kept = {t: r["kept_from"] for t, r in st.get("ours", {}).items() if "kept_from" in r}
    if not kept:
        return []
    return [
        "",
        "bitmosaic rows kept from an earlier run, not re-quantized (no paired interval: that run kept no "
        "per-chunk NLL): " + "; ".join(f"{t} ({why})" for t, why in kept.items()) + ".",
    ]


def _not_run(st: dict, typ: str) -> str:
    if typ in st.get("failed", {}):  # a quantization that stopped with an error (its log's last line)
        return f"failed: {st['failed'][typ]}"
    if typ in st.get("not_rerun", {}):  # a row whose earlier measurement no longer holds (the reason)
        return f"not rerun: {st['not_rerun'][typ]}"
    return "not run" if typ in OURS else "not implemented"


def report(st: dict, a) -> str:
    p, dec = st.get("ppl", {}), st.get("decode", {})
    lines = [
        f"# bitmosaic GGUF vs llama.cpp (imatrix) on {a.model}, llama.cpp's own perplexity tool",
        "",
        "llama.cpp tools built from llama-cpp-python 0.3.36's vendor/llama.cpp "
        "(benchmarks/peers/llama_tools.py); "
        f"`llama-perplexity -c {CTX} --chunks {CHUNKS}` on WikiText-2 raw test, KL and top-1 against the F16 "
        "file's "
        f"logits in the same pass; imatrix from `llama-imatrix -c {CTX} --chunks {CALIB_CHUNKS}` on "
        "wikitext-2/valid.txt; bitmosaic: `--method gptq --gguf-type T` calibrated on the same 16 x 512 "
        "chunks, "
        "exported without --lossy.  Each cell: perplexity (file MB, mean KL, top-1 agreement).  2 threads.  "
        "bitmosaic vs imatrix: perplexity ratio with its paired bootstrap 95% interval over the "
        f"{CHUNKS} chunks (2000 resamples of each chunk's mean NLL, recovered from llama-perplexity's "
        "running perplexity), *within noise* where it holds 1.",
        "",
        "Reproduce: `flock /tmp/locks/heavy python -m benchmarks.gguf.llamacpp_peers --budget 280` "
        "(repeat until done), then `--decode` alone for the last column",
        "",
        "| type | llama.cpp, no imatrix | llama.cpp + imatrix | bitmosaic | bitmosaic vs imatrix "
        "| decode tok/s (no imatrix / + imatrix / bitmosaic) |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("F32", "F16"):
        if key in p:
            lines.append(f"| {key} | {_cell(p[key])} | | | | {_speed(dec, key)} |")
    for typ in (*TYPES, *(t for t in OURS if t.startswith(BPW))):
        peer = typ.removeprefix(BPW)
        plain, imat, ours = (
            p.get(f"llama {peer} plain"),
            p.get(f"llama {peer} imatrix"),
            p.get(f"bitmosaic {typ}"),
        )
        ref = st.get("refused", {})
        c_plain = (
            _cell(plain) if plain else (f"refused: {ref[f'{peer} plain']}" if f"{peer} plain" in ref else "-")
        )
        vs = _vs(ours, imat)
        speeds = (
            " / ".join(
                ("-", "-")
                if typ.startswith(BPW)
                else (_speed(dec, f"llama {peer} plain"), _speed(dec, f"llama {peer} imatrix"))
            )
            + f" / {_speed(dec, f'bitmosaic {typ}')}"
        )
        lines.append(
            f"| {typ} | {c_plain} | {_cell(imat)} | "
            f"{_cell(ours) if ours else _not_run(st, typ)} | {vs} "
            f"| {speeds} |"
        )
    lines += ["", "## tensor types per file (2-D)", ""]
    for key, r in p.items():
        lines.append(f"- {key}: {', '.join(f'{t} x{n}' for t, n in r['types'].items())}")
    differ = [
        t
        for t in TYPES
        if f"bitmosaic {t}" in p
        and f"llama {t} imatrix" in p
        and p[f"bitmosaic {t}"]["types"] != p[f"llama {t} imatrix"]["types"]
    ]
    if differ:
        lines += [
            "",
            "bitmosaic rows whose per-tensor types differ from llama.cpp's imatrix file (see the list "
            f"above): {', '.join(differ)}.",
        ]
    bpw = {t: r["target_bpw"] for t, r in st.get("ours", {}).items() if "target_bpw" in r}
    lines += [
        "",
        "`bpw@P`: bitmosaic `--gguf-target-bpw B` with B the exact bits per weight of the linears in "
        "preset P's mix ("
        + ", ".join(f"{t}: B = {b:.4f}" for t, b in bpw.items())
        + "), compared with P's files (equal bytes).  bitmosaic rows re-measured one type at a time "
        "(`--skip-llama --types T`) keep the llama.cpp rows of the earlier run (same tools, same imatrix "
        "protocol); 'not run': not measured by the run's deadline.",
        *_kept_note(st),
        "",
        *_decode_note(dec),
    ]
    return "\n".join(lines)
