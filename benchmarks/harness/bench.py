""":class:`Bench`, which loads SmolLM2-135M once, runs quantization configs on fresh copies of the
float model and measures perplexity (with KL and top-1 to the float model on the verdict protocol)."""

from __future__ import annotations

import copy
import sys
import time

import torch

from benchmarks.harness.float_reference import CachedReference, default_store
from benchmarks.harness.machine import cpu_name
from benchmarks.harness.protocols import merged_rows, protocol_label, settle_protocol
from benchmarks.harness.writers import RESULTS, dumps_results, write_results
from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
from bitmosaic.eval.perplexity import perplexity
from bitmosaic.io import load_model
from bitmosaic.io.saved.outdir import atomic_write_text
from bitmosaic.methods import get_method
from bitmosaic.modules import QuantModule, set_weight_cache
from bitmosaic.pipeline import RunSettings, quantize_model
from bitmosaic.pipeline.pipeline import peak_rss_mb


def round_window_nll(values) -> list[float]:
    """Per-window NLLs as a result file keeps them: 6 significant digits (a verdict row's 589 windows
    cost ~5 kB of JSON)."""
    return [float(f"{v:.6g}") for v in values]


def act_paths(model, device: str = "cpu") -> dict[str, int]:
    """How the quantized layers with an activation quantizer (their own, a run-time one, or SQ-format's
    split) compute on ``device``: ``{"integer": n, "simulated": m}`` (integer: the layer's
    integer kernel ran, :mod:`bitmosaic.modules.intact`; simulated: float32 fake quantization), empty
    for a weight-only or float model.  Both paths compute the same integers; outputs differ by float32
    rounding (``int_ppl.py`` measures what that does to perplexity)."""
    n = {"integer": 0, "simulated": 0}
    for m in model.modules():
        if not isinstance(m, QuantModule) or (m.act_quantizer() is None and not m.QUANTIZES_OWN_INPUTS):
            continue
        # the layer's own decision for an input of this run's device (an empty one: nothing is computed)
        x = torch.empty(0, m.in_features, device=device)
        n["integer" if m.runs_int_act(x) else "simulated"] += 1
    return {k: v for k, v in n.items() if v}


class Bench:
    progress = False  # progress bars: set from --progress (or a terminal) by __init__

    def __init__(self, args):
        if args.threads:
            torch.set_num_threads(args.threads)
        if getattr(args, "nsamples", None) is None:  # arguments not from base_parser().parse_args
            settle_protocol(args)
        self.args = args
        self.device = getattr(args, "device", "cpu") or "cpu"
        self.progress = bool(getattr(args, "progress", False)) or sys.stderr.isatty()
        self.model, self.tok = load_model(args.model)
        self.calib = calibration_samples(
            self.tok, "wikitext2", args.nsamples, args.seqlen, args.seed, data_dir=args.data_dir
        )
        self.eval_ids = eval_tokens(self.tok, "wikitext2", data_dir=args.data_dir)
        self.rows: list[dict] = []
        self._seen: set[str] = set()  # row names offered to --only (finish names the ones it never met)
        # the float model where the evaluation runs, for KL and top-1 (self.model stays the CPU original)
        self.reference = None
        if getattr(args, "fidelity", False):
            ref = self.model if self.device == "cpu" else copy.deepcopy(self.model).to(self.device)
            store = getattr(args, "reference_cache", None) or default_store()
            self.reference = CachedReference(ref, None if str(store).lower() == "none" else store)

    def measure(self, model) -> dict:
        """Perplexity (and, with ``--fidelity``/``--protocol verdict``, KL and top-1 to the float model
        from the same pass) of ``model`` on the run's test windows, evaluated on ``--device`` (8 windows
        per forward on a GPU, one on the CPU; the float model itself gets KL 0 and top-1 1 without a
        second pass)."""
        itself = model is self.model
        if not itself:
            # the same weights every window: dequantize each layer once, not in every forward (a DPQ
            # layer re-rounded its FP8 tiles in each: its W4A8 eval took 3.7x as long); activation
            # quantizers and integer activation paths run as before
            set_weight_cache(model, True)
        # the float row runs through the cached reference: the same logits bit for bit (or the whole
        # forward where they would differ), and the rows after it re-apply only the output head
        target = self.reference if itself and self.reference is not None else model
        r = perplexity(
            target,
            self.eval_ids,
            self.args.seqlen,
            max_windows=self.args.max_windows,
            batch_size=1 if self.device == "cpu" else 8,
            progress=self.progress,
            device=self.device,
            bos_token_id=bos_token_id(self.tok),
            reference=None if itself else self.reference,
            per_window=True,
        )
        out = {k: r[k] for k in ("ppl", "kl_mean", "top1_agreement", "windows") if k in r}
        # each window's mean NLL, for a paired bootstrap of two rows of the same windows (issue 73):
        # float32's ~7 digits, rounded to 6 (a difference of two rows is still ~1e-5 exact per window)
        out["window_nll"] = round_window_nll(r["window_nll"])
        paths = act_paths(model, self.device)
        if paths:
            out["act_compute"] = paths
        if itself and self.reference is not None:
            out.update(kl_mean=0.0, top1_agreement=1.0)
        return out

    def ppl(self, model) -> float:
        return self.measure(model)["ppl"]

    def float_row(self) -> dict | None:
        """The float model's row, named ``float`` (None when ``--only`` leaves it out)."""
        if not self.wants("float"):
            return None
        t = time.perf_counter()
        row = {"name": "float", "method": "float", "bits_per_weight": 32.0, **self.measure(self.model)}
        row["eval_seconds"] = time.perf_counter() - t
        return self._add(row)

    def wants(self, name: str) -> bool:
        """Whether ``--only`` (a comma list of row names) leaves row ``name`` to run (a name with commas of
        its own, ``no sparse, alpha kept``, counts where it stands whole between the list's commas)."""
        only = getattr(self.args, "only", None)
        self.__dict__.setdefault("_seen", set()).add(name)
        return not only or f",{name}," in f",{only},"

    def offer(self, names) -> None:
        """Make ``names`` known to ``--only`` before their turn: a run of several parts (one ``finish``
        each) then does not call a later part's rows unknown."""
        self.__dict__.setdefault("_seen", set()).update(names)

    def run(self, name: str, method: str, **options) -> dict | None:
        """Quantize a fresh copy with ``method``/``options`` and measure it; None when ``--only``
        leaves this row out."""
        if not self.wants(name):
            return None
        spec = get_method(method)
        cfg = spec.make_config(**options)
        model = copy.deepcopy(self.model)
        settings = RunSettings(progress=self.progress, measure_errors=True, device=self.device)
        rep = quantize_model(model, self.calib, spec, cfg, settings)
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
            **self.measure(model),
        }
        row["eval_seconds"] = time.perf_counter() - t
        row["layers"] = rep.layers
        del model
        return self._add(row)

    def _add(self, row: dict) -> dict:
        # rows accumulate over sessions and machines: each names the CPU its times were measured on
        row.setdefault("cpu", cpu_name())
        self.rows.append(row)
        if getattr(self, "partial_path", None):  # keep what is done if a long run is interrupted
            # with the run's settings, so a run cut short resumes: copy the partial file to the JSON's
            # path and rerun with --only the missing rows (they join it: merged_rows)
            rows = [{k: v for k, v in r.items() if k != "layers"} for r in self.rows]
            out = {
                "partial": True,
                "args": vars(self.args),
                "protocol": protocol_label(self.args),
                "rows": rows,
            }
            atomic_write_text(self.partial_path, dumps_results(out))
        ppl = row["ppl"]
        print(
            f"  {row['name']:<34} ppl {ppl:9.3f}  bpw {row['bits_per_weight']:6.3f}"
            + (f"  KL {row['kl_mean']:.4f}  top-1 {row['top1_agreement']:.4f}" if "kl_mean" in row else "")
            + (f"  quant {row['quant_seconds']:6.1f}s" if "quant_seconds" in row else ""),
            flush=True,
        )
        return row

    def finish(self, name: str, columns: list[str], extra: dict | None = None) -> None:
        a = self.args
        rest = f",{getattr(a, 'only', None) or ''},"
        for seen in sorted(self._seen, key=len, reverse=True):  # names with commas first
            while f",{seen}," in rest:  # replace() skips the second of two adjacent repeats
                rest = rest.replace(f",{seen},", ",,")
        unknown = [n for n in rest.split(",") if n]
        if unknown:  # a typo, or a row name cut at one of its own commas
            print(f"note: --only names no row of this benchmark: {', '.join(unknown)}", flush=True)
        windows = "every window" if a.max_windows is None else f"first {a.max_windows}"
        print(
            f"\n{name}: {a.model}, {protocol_label(a)} protocol: calib {a.nsamples}x{a.seqlen} "
            f"(seed {a.seed}), eval wikitext2 {windows} x{a.seqlen} on {self.device}"
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
        out = {"args": vars(a), "protocol": protocol_label(a), "peak_rss_mb": peak_rss_mb()}
        out.update(rows=merged_rows(a.json or RESULTS / f"{name}.json", a, self.rows), **(extra or {}))
        write_results(a.json, name, out)
