"""GPTQModel reads bitmosaic's GPTQ exports: are its dequantized weights ours, bit for bit, and are its logits
and perplexity ours?

GPTQModel (ModelCloud's GPTQ toolkit, an independent loader and the one transformers' GPTQ integration
calls) loads ``bitmosaic export --format gptq`` folders on the CPU with its pure-PyTorch kernel
(``BACKEND.TORCH`` -> ``TorchLinear``, the kernel it also picks by itself on a CPU).  For each config:

1. quantize with bitmosaic GPTQ (the tiny random Llama of :mod:`bitmosaic.testing`, in process, and
   SmolLM2-135M with the ``bitmosaic quantize`` command line: 4 bits, group 128, 16 x 512 calibration
   tokens), default act-order (permuted ``g_idx``, ``desc_act: true``) and ``--static-groups``
   (contiguous groups, ``desc_act: false``); asymmetric (exported ``gptq_v2``, now their default)
   and ``--sym`` (exported as plain ``gptq`` v1);
2. ``bitmosaic export DIR --format gptq --out OUT``;
3. load OUT with ``GPTQModel.load(OUT, device="cpu", backend=BACKEND.TORCH, dtype=...)`` and DIR with
   ``bitmosaic.load(DIR)`` (float32);
4. weights, layer by layer: GPTQModel's own ``dequantize_weight()`` (a) as it runs (its dtype: float16
   scales and products) against bitmosaic's exact float32 weight rounded to float16, and (b) the same
   GPTQModel unpacking with its scales widened to float32 (so no rounding at all) against bitmosaic's
   float32 weight; both must be ``torch.equal``;
5. logits on fixed tokens (SmolLM2: the first ``--windows`` 512-token windows of WikiText-2 raw test,
   BOS + 511 text tokens each, as ``bitmosaic.eval.perplexity`` cuts them; the tiny model: seeded random
   ids of its 128-word vocabulary): max |diff|, max |diff| / max |logit|, ||diff|| / ||logits||, top-1
   agreement, KL(bitmosaic || other), and each model's perplexity on those windows.  Rows: GPTQModel in
   float16 and in bfloat16 (the dtype its loader picks by itself on a CPU), and bitmosaic's own model in
   float16 (how far half precision alone moves the logits), all against bitmosaic in float32 (the
   GPTQModel bfloat16 row for the tiny configs and the first SmolLM2 one only); for two tiny 4-bit
   configs also GPTQModel with the kernel it picks by itself on a CPU (``BACKEND.AUTO``).

Also recorded: GPTQModel on an asymmetric export in the default ``gptq`` (v1) format.

GPTQModel wraps ``TorchLinear.dequantize_weight`` in ``torch.compile`` (inductor); on a 2-core CPU that
costs about 20 s per tiny model and far more for SmolLM2, so it is switched off here
(``TORCH_COMPILE_DISABLE=1``: the same function runs eagerly), except for the one tiny row marked
``compile``.

Needs ``gptqmodel`` (not a bitmosaic dependency; see benchmarks/results/gptqmodel_check.md for how it was
installed on a CPU-only machine).  Every step keeps its output under ``--work`` and is skipped when it is
there.  Reproduce::

    BUILD_CUDA_EXT=0 pip install --no-deps gptqmodel==7.3.6 ...   # see the results file
    nice -n 19 python -m benchmarks.peers.gptqmodel_check --threads 2
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # before torch is imported (see the module doc)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.metadata as md  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.harness import RESULTS, machine_info, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# name -> settings.  tiny: quantize_ options (group 32: its layers are 64 and 96 wide); smollm2: CLI flags.
# auto: also GPTQModel's own choice of kernel on a CPU (BACKEND.AUTO: TorchAtenLinear for 4 bits, which
# computes in bfloat16 whatever the dtype), with its own dtype and with float16.
# bf16: also GPTQModel in bfloat16 (a bfloat16 SmolLM2 forward through GPTQModel took 40 minutes on this
# loaded 2-core CPU: once is enough)
CONFIGS = {
    "tiny w4 act asym v2": {"model": "tiny", "opts": {"bits": 4, "group_size": 32}, "v2": True, "auto": True},
    "tiny w4 act asym v2 compile": {
        "model": "tiny", "opts": {"bits": 4, "group_size": 32}, "v2": True, "compile": True,
    },
    "tiny w4 act sym v1": {"model": "tiny", "opts": {"bits": 4, "group_size": 32, "sym": True}, "v2": False},
    "tiny w4 static asym v2": {
        "model": "tiny", "opts": {"bits": 4, "group_size": 32, "static_groups": True}, "v2": True,
    },
    "tiny w4 static sym v1": {
        "model": "tiny", "opts": {"bits": 4, "group_size": 32, "static_groups": True, "sym": True},
        "v2": False, "auto": True,
    },
    "tiny w3 act sym v1": {"model": "tiny", "opts": {"bits": 3, "group_size": 32, "sym": True}, "v2": False},
    "tiny w2 act asym v2": {"model": "tiny", "opts": {"bits": 2, "group_size": 32}, "v2": True},
    "tiny w8 static sym v1": {
        "model": "tiny", "opts": {"bits": 8, "group_size": 32, "static_groups": True, "sym": True},
        "v2": False,
    },
    "smollm2 w4 g128 act asym v2": {"model": "smollm2", "flags": [], "v2": True},
    "smollm2 w4 g128 static asym v2": {
        "model": "smollm2", "flags": ["--static-groups"], "v2": True, "bf16": False,
    },
    "smollm2 w4 g128 act sym v1": {
        "model": "smollm2", "flags": ["--sym"], "v2": False, "bf16": False,
    },
}  # fmt: skip
# asymmetric exports in the default v1 format: does GPTQModel load them?
V1_ASYM_PROBES = {
    "tiny w4 act asym v1": "tiny w4 act asym v2",
    "smollm2 w4 g128 act asym v1": "smollm2 w4 g128 act asym v2",
}


def versions() -> dict:
    out = {}
    for p in (
        "gptqmodel",
        "torch",
        "transformers",
        "accelerate",
        "safetensors",
        "numpy",
        "torchvision",
        "torchao",
    ):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    from bitmosaic import __version__

    out["bitmosaic"] = __version__
    with contextlib.suppress(Exception):
        out["bitmosaic_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return out


def quant_dir(name: str) -> str:
    """The bitmosaic folder of a config (configs that differ only in export or loading share it)."""
    cfg = CONFIGS[name]
    if cfg["model"] == "smollm2":
        return (
            "smollm2_"
            + ("static" if "--static-groups" in cfg["flags"] else "act")
            + ("_sym" if "--sym" in cfg["flags"] else "")
        )
    return "tiny_" + "_".join(f"{k}-{v}" for k, v in sorted(cfg["opts"].items()))


# -- the two loaders ----------------------------------------------------------------------------------
def load_gptqmodel(out: Path, dtype: torch.dtype | None, auto: bool = False):
    """``GPTQModel.load`` on the CPU with its torch kernel (``auto``: the kernel and, with ``dtype=None``,
    the dtype its loader picks); returns the transformers model inside."""
    from gptqmodel import BACKEND, GPTQModel

    kw = {} if dtype is None else {"dtype": dtype}
    with contextlib.redirect_stdout(sys.stderr):  # it prints the whole config
        gm = GPTQModel.load(str(out), device="cpu", backend=BACKEND.AUTO if auto else BACKEND.TORCH, **kw)
    return gm.model.eval()


def gptqmodel_layers(model) -> dict:
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)}


def bitmosaic_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if hasattr(m, "layer_config")}


def compare_weights(gq_model, bm_model) -> dict:
    """GPTQModel's ``dequantize_weight`` of every quantized layer against bitmosaic's weight."""
    gq, bm = gptqmodel_layers(gq_model), bitmosaic_layers(bm_model)
    res = {
        "layers": len(bm),
        "same_names": sorted(gq) == sorted(bm),
        "kernels": sorted({type(m).__name__ for m in gq.values()}),
    }
    native_eq = exact_eq = 0
    native_max = exact_max = 0.0
    first_bad = None
    with torch.no_grad():
        for name, b in bm.items():
            g = gq.get(name)
            if g is None:
                first_bad = first_bad or f"{name}: not a GPTQModel quantized layer"
                continue
            wb = b.dequantize_reference(torch.float32)  # [out, in], exact
            native = g.dequantize_weight().t()  # [out, in] in the kernel's dtype
            ok = native.shape == wb.shape and torch.equal(native, wb.to(native.dtype))
            native_eq += ok
            if native.shape == wb.shape:
                native_max = max(
                    native_max, float((native.float() - wb.to(native.dtype).float()).abs().max())
                )
            scales = g.scales.data
            g.scales.data = scales.float()
            try:  # the class's function: the eager one even where the instance's is compiled
                exact = type(g).dequantize_weight(g).t()
            finally:
                g.scales.data = scales
            ok32 = exact.dtype == torch.float32 and exact.shape == wb.shape and torch.equal(exact, wb)
            exact_eq += ok32
            if exact.shape == wb.shape:
                exact_max = max(exact_max, float((exact.float() - wb).abs().max()))
            if not (ok and ok32) and first_bad is None:
                first_bad = name
            res.setdefault("native_dtype", str(native.dtype).replace("torch.", ""))
    res.update(
        native_equal=native_eq,
        native_max_abs_diff=native_max,
        float32_equal=exact_eq,
        float32_max_abs_diff=exact_max,
        bit_identical=native_eq == exact_eq == len(bm) and res["same_names"],
        first_mismatch=first_bad,
    )
    return res


# -- logits -------------------------------------------------------------------------------------------
def logits_of(model, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for b in batches:
            out.append(model(b, use_cache=False).logits.float())
    return out


def compare_logits(ref: list[torch.Tensor], other: list[torch.Tensor], batches: list[torch.Tensor]) -> dict:
    max_abs = ref_max = 0.0
    d2 = r2 = 0.0
    agree = total = 0
    kl = 0.0
    for a, b in zip(ref, other, strict=True):
        d = (b - a).abs()
        max_abs = max(max_abs, float(d.max()))
        ref_max = max(ref_max, float(a.abs().max()))
        d2 += float((d.double() ** 2).sum())
        r2 += float((a.double() ** 2).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0] * a.shape[1]
        la, lb = F.log_softmax(a, -1), F.log_softmax(b, -1)
        kl += float((la.exp() * (la - lb)).sum(-1).double().sum())
    return {
        "max_abs_diff": max_abs,
        "max_rel_diff": max_abs / ref_max,
        "rel_l2": math.sqrt(d2 / r2),
        "top1_agreement": agree / total,
        "kl_mean": kl / total,
        "ppl": ppl(other, batches),
    }


def ppl(logits: list[torch.Tensor], batches: list[torch.Tensor]) -> float:
    nll = n = 0.0
    for lg, b in zip(logits, batches, strict=True):
        nll += float(
            F.cross_entropy(
                lg[:, :-1].reshape(-1, lg.shape[-1]), b[:, 1:].reshape(-1), reduction="sum"
            ).double()
        )
        n += b[:, 1:].numel()
    return math.exp(nll / n)


# -- making the folders ---------------------------------------------------------------------------------
def quantize_tiny(folder: Path, opts: dict) -> None:
    from bitmosaic import quantize_
    from bitmosaic.io import save_quantized
    from bitmosaic.testing import SPECIALS, VOCAB, tiny_llama, word_tokenizer

    m = tiny_llama(seed=3)
    calib = torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_(m, "gptq", calib, progress=False, **opts)
    save_quantized(m, folder, {"method": "gptq", **opts}, tokenizer=word_tokenizer(), overwrite=True)


def quantize_smollm2(folder: Path, flags: list[str], a) -> dict:
    cmd = [
        sys.executable, "-m", "bitmosaic", "quantize", "--model", "smollm2-135m", "--method", "gptq",
        "--bits", "4", "--group-size", "128", "--nsamples", str(a.nsamples), "--seqlen", "512",
        "--no-progress", *flags, "--out", str(folder),
    ]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return {"command": " ".join(["bitmosaic", *cmd[3:]]), "seconds": time.perf_counter() - t}


def export(folder: Path, out: Path, v2: bool) -> dict:
    from bitmosaic.io.export import export_model

    t = time.perf_counter()
    res = export_model(folder, out, "gptq", gptq_v2=v2, overwrite=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    keep = ("bits", "group_size", "desc_act", "sym", "checkpoint_format")
    return {
        "seconds": time.perf_counter() - t,
        "changed": bool(res.changed),
        "notes": list(res.notes),
        "quantization_config": {k: qc[k] for k in keep},
    }


# -- main -----------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=str(ROOT / "runs" / "gptqmodel_check"))
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--windows", type=int, default=4, help="SmolLM2: 512-token WikiText-2 windows compared")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--only", default=None, help="comma list of config name prefixes, e.g. tiny (default: all)"
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}

    def save_state():
        state_path.write_text(json.dumps(state, indent=2))

    import bitmosaic

    only = [x.strip() for x in a.only.split(",")] if a.only else [""]
    names = [n for n in CONFIGS if any(n.startswith(x) for x in only)]
    smol_batches = tiny_batches = None
    for name in names:
        cfg = CONFIGS[name]
        row = state.setdefault(name, {})
        if "logits" in row:
            continue
        folder, out = work / quant_dir(name), work / (name.replace(" ", "_") + ".gptq")
        if not (folder / "config.json").exists():
            print(f"[{name}] quantize -> {folder}", flush=True)
            if folder.exists():
                shutil.rmtree(folder)
            if cfg["model"] == "tiny":
                quantize_tiny(folder, cfg["opts"])
                row["quantize"] = {"api": f"quantize_(tiny_llama(seed=3), 'gptq', calib, **{cfg['opts']})"}
            else:
                row["quantize"] = quantize_smollm2(folder, cfg["flags"], a)
        row.setdefault("quantize", {"folder": str(folder)})
        if cfg["model"] == "smollm2" and "command" not in row["quantize"]:
            row["quantize"]["command"] = (
                f"bitmosaic quantize --model smollm2-135m --method gptq --bits 4 --group-size 128 --nsamples "
                f"{a.nsamples} --seqlen 512 {' '.join(cfg['flags'])} --out DIR".replace("  ", " ")
            )
        print(f"[{name}] export -> {out}", flush=True)
        row["export"] = export(folder, out, cfg["v2"])

        bm = bitmosaic.load(folder).eval()
        if cfg["model"] == "smollm2":
            if smol_batches is None:
                smol_batches = smollm2_windows(folder, a.windows)
            batches = smol_batches
        else:
            if tiny_batches is None:
                from bitmosaic.testing import SPECIALS, VOCAB

                g = torch.Generator().manual_seed(1)
                tiny_batches = [torch.randint(len(SPECIALS), VOCAB, (4, 64), generator=g)]
            batches = tiny_batches
        row["tokens"] = {"windows": sum(b.shape[0] for b in batches), "seqlen": batches[0].shape[1]}
        t = time.perf_counter()
        ref = logits_of(bm, batches)
        row["bitmosaic_fp32"] = {"ppl": ppl(ref, batches), "seconds": time.perf_counter() - t}

        torch._dynamo.config.disable = not cfg.get("compile", False)
        logits = {}
        bf16 = cfg.get("bf16", True) and not cfg.get("compile")
        for dtype in (torch.float16, torch.bfloat16) if bf16 else (torch.float16,):
            key = f"gptqmodel_{str(dtype).replace('torch.', '')}"
            t = time.perf_counter()
            gq = load_gptqmodel(out, dtype)
            load_s = time.perf_counter() - t
            if dtype == torch.float16:
                row["weights"] = compare_weights(gq, bm)
                print(f"[{name}] weights: {row['weights']}", flush=True)
            t = time.perf_counter()
            logits[key] = compare_logits(ref, logits_of(gq, batches), batches)
            logits[key].update(load_seconds=load_s, forward_seconds=time.perf_counter() - t)
            print(f"[{name}] {key}: {logits[key]}", flush=True)
            del gq
        torch._dynamo.config.disable = True
        for dtype in (None, torch.float16) if cfg.get("auto") else ():
            gq = load_gptqmodel(out, dtype, auto=True)
            kern = ", ".join(sorted({type(m).__name__ for m in gptqmodel_layers(gq).values()}))
            key = f"gptqmodel_auto {kern} {str(next(gq.parameters()).dtype).replace('torch.', '')}"
            t = time.perf_counter()
            logits[key] = compare_logits(ref, logits_of(gq, batches), batches)
            logits[key]["forward_seconds"] = time.perf_counter() - t
            print(f"[{name}] {key}: {logits[key]}", flush=True)
            del gq
        if not cfg.get("compile"):
            bm16 = bitmosaic.load(folder, dtype=torch.float16).eval()
            t = time.perf_counter()
            logits["bitmosaic_float16"] = compare_logits(ref, logits_of(bm16, batches), batches)
            logits["bitmosaic_float16"]["forward_seconds"] = time.perf_counter() - t
            del bm16
        row["logits"] = logits
        del bm
        save_state()

    for name, base in V1_ASYM_PROBES.items():
        if name in state or (a.only and base not in names):
            continue
        folder = work / quant_dir(base)
        if not (folder / "config.json").exists():
            continue
        out = work / (name.replace(" ", "_") + ".gptq")
        row = state.setdefault(name, {})
        try:
            row["export"] = export(folder, out, v2=False)
        except Exception as e:  # bitmosaic refuses a v1 export with a zero-point of 0
            row["export"] = {"error": f"{type(e).__name__}: {e}"}
            save_state()
            continue
        try:
            load_gptqmodel(out, torch.float16)
            row["gptqmodel"] = "loaded"
        except Exception as e:
            row["gptqmodel"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        save_state()

    _report(a, state)


def smollm2_windows(folder: Path, windows: int) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    from bitmosaic.data import bos_token_id, eval_tokens
    from bitmosaic.eval.perplexity import eval_windows

    tok = AutoTokenizer.from_pretrained(folder)
    ids = eval_windows(eval_tokens(tok, "wikitext2"), 512, windows, bos_token_id(tok))
    return [ids[i : i + 1] for i in range(ids.shape[0])]


INSTALL = """
## Install (CPU-only machine; torch 2.13.0+cpu and transformers 5.24.0 kept as they are)

1. `python -m venv --system-site-packages ENV`
2. `BUILD_CUDA_EXT=0 ENV/bin/pip install --no-deps gptqmodel==7.3.6`: a pure-Python sdist, about 10 s (its
   CUDA/C++ kernels are not built; the torch kernel needs none).  Not with its dependencies: it pins
   `numpy==2.2.6`, and resolving `torchvision` pulls torch 2.14.1 with the CUDA 13 wheels.
3. `ENV/bin/pip install --no-deps device-smi protobuf pypcre tokenicer logbar defuser torchao`, about 20 s
   (accelerate, safetensors, threadpoolctl, datasets, pyarrow, dill, pillow, jinja2 and ninja were already
   there; `maturin` is listed but not imported).
4. `import gptqmodel` imports `torchvision.transforms` (its InternVL definition).  The torchvision built
   for torch 2.13 (0.28.0, `--no-deps`) is a CUDA build: its `_C` ops need libtorch_cuda, and with a CPU
   torch its `_meta_registrations.py` fails at import (`operator torchvision::nms does not exist`).  In
   ENV only, the two `register_fake("torchvision::nms" / "qnms")` decorators of that file were made
   conditional on `torchvision.extension._has_ops()`.  No torchvision op runs here.
"""


def _report(a, state: dict) -> None:
    ver = versions()
    lines = [
        "# GPTQModel loads bitmosaic's GPTQ exports (CPU, torch kernel)",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v) + ".",
        "",
        "Reproduce: `nice -n 19 python -m benchmarks.peers.gptqmodel_check --threads 2` (in an environment "
        "with gptqmodel; see *Install* below).",
        "",
        "## Weights: GPTQModel's `dequantize_weight()` against bitmosaic's, every quantized layer",
        "",
        "Equal in float16: GPTQModel's dequantized weight as its kernel computes it (float16) is bitmosaic's "
        "exact float32 weight rounded to float16, `torch.equal`.  Equal in float32: the same GPTQModel "
        "unpacking with its scales widened to float32 gives bitmosaic's float32 weight exactly.",
        "",
        "| config | export (bits, group, desc_act, sym, format) | layers | kernel | equal in float16 "
        "| equal in float32 | bit-identical |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for name in CONFIGS:
        r = state.get(name)
        if not r or "weights" not in r:
            continue
        q, w = r["export"]["quantization_config"], r["weights"]
        fmt = f"{q['bits']}, {q['group_size']}, {q['desc_act']}, {q['sym']}, {q['checkpoint_format']}"
        lines.append(
            f"| {name} | {fmt} | {w['layers']} | {', '.join(w['kernels'])} "
            f"| {w['native_equal']}/{w['layers']} | {w['float32_equal']}/{w['layers']} "
            f"| {'yes' if w['bit_identical'] else 'NO: ' + str(w['first_mismatch'])} |"
        )
    lines += [
        "",
        "## Logits against bitmosaic's model in float32 (same tokens)",
        "",
        "| config | tokens | model | max abs diff | max abs diff / max logit | rel L2 | top-1 agreement "
        "| KL mean (nats) | ppl | bitmosaic fp32 ppl |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in CONFIGS:
        r = state.get(name)
        if not r or "logits" not in r:
            continue
        tk = r["tokens"]
        what = f"{tk['windows']} x {tk['seqlen']}" + (
            " WikiText-2" if name.startswith("smollm2") else " random ids"
        )
        for key, m in r["logits"].items():
            label = key.replace("_", " ")
            lines.append(
                f"| {name} | {what} | {label} | {m['max_abs_diff']:.3g} | {m['max_rel_diff']:.2e} "
                f"| {m['rel_l2']:.2e} | {m['top1_agreement']:.4f} | {m['kl_mean']:.2e} | {m['ppl']:.4f} "
                f"| {r['bitmosaic_fp32']['ppl']:.4f} |"
            )
    lines += [
        "",
        "Reading it: GPTQModel's float16 rows and bitmosaic's own float16 rows sit at the same distance from "
        "bitmosaic in float32 (same weights, half-precision activations); GPTQModel in bfloat16 (what its "
        "loader picks on a CPU when no dtype is given) also rounds the float16 scales to bfloat16, so its "
        "weights are no longer ours and the logits move about ten times further.  `gptqmodel auto` rows: "
        "GPTQModel's default CPU kernel for 4 bits (`TorchAtenLinear`, aten's `_weight_int4pack_mm_for_cpu`) "
        "converts scales and zero-points to bfloat16 offsets and runs in bfloat16 even when loaded in "
        "float16: a kernel property, not a reading of the checkpoint.",
    ]
    probes = [(n, state[n]) for n in V1_ASYM_PROBES if n in state]
    if probes:
        lines += ["", "## Asymmetric export in the default `gptq` (v1) format", ""]
        for n, r in probes:
            if "error" in r.get("export", {}):
                lines.append(f"- {n}: bitmosaic refuses the export: {r['export']['error']}")
            else:
                lines.append(f"- {n}: exported; GPTQModel: {r.get('gptqmodel')}")
    smol = [state[n]["quantize"] for n in CONFIGS if n.startswith("smollm2") and n in state]
    if smol:
        lines += ["", "SmolLM2 commands: " + "; ".join(f"`{q['command']}`" for q in smol if "command" in q)]
    notes = sorted({x for n in CONFIGS if n in state for x in state[n].get("export", {}).get("notes", [])})
    if notes:
        lines += ["", "Export notes: " + "; ".join(notes)]
    lines += ["", *INSTALL.strip().splitlines()]
    out = {"args": vars(a), "versions": ver, "state": state, "machine": machine_info(**ver)}
    write_results(a.json or RESULTS / "gptqmodel_check.json", "gptqmodel_check", out, "\n".join(lines))


if __name__ == "__main__":
    main()
