"""``bitmosaic compare``: many quantization configs on one model, one table, one Pareto plot.

Configs are written ``method:setting[;option...]``, comma-separated, e.g.
``"rtn:w4g128, gptq:w3g128, gptq:w4g128;order=natural, smoothquant:w8a8, sfmp:bpw3.25, mosaic:w4a4"``:

* ``w<B>`` weight bits, ``g<G>`` group size (``gch`` or ``g-1``: per-channel), ``a<A>`` activation bits
  (``w4a8`` is the scheme ``W4A8``; a suffix ``-fp8``/``-fp4`` picks float activations: ``w4a8-fp8``),
  ``bpw<X>`` a bits-per-weight budget (methods that take ``--bpw``), ``sym``/``asym``;
* after ``;``: ``key=value`` (the CLI flag ``--key value``) or ``flag`` (``--flag``).

So a config is nothing but ``bitmosaic quantize`` flags: every method and option the CLI knows works,
and adding a method to a comparison needs no code here.  ``--configs FILE`` takes a JSON or YAML list
of ``{"name": ..., "method": ..., <option>: <value>, ...}`` instead (options as CLI flag names).

Each config runs in its own ``bitmosaic quantize`` process (so its time and peak memory are its own),
with ``--fidelity`` (KL and top-1 against the float model on the evaluation windows) and ``--json``;
the float model is measured once by ``bitmosaic eval``.  Results go to ``OUT/runs/<slug>.json``,
written atomically when a config finishes: a rerun skips finished configs (resumable), and an
interrupted one leaves nothing behind and starts over.  Each config's process runs in its own process
group; stopping compare (SIGINT, SIGTERM) stops it too, so no orphan keeps writing.  Then
``OUT/results.{csv,json,md}`` and ``OUT/pareto.png`` are (re)written from every finished run.  ``OUT``
must be new, empty or a compare folder (``OUT/compare.json``, written first, marks one): a folder of
other files is refused, never overwritten (:func:`check_compare_out`).

What is shared between configs: the float model's evaluation, the calibration samples (the same
``--seed`` draws the same samples) and, through one calibration cache folder passed to every config
(:mod:`bitmosaic.pipeline.calib_cache`), the statistics of the *float* model: the inputs of the first
decoder layer, layer 0's smoothing statistics and the SFMP Fisher salience.  The column ``cache_hits``
says which each config found there.  Other Hessians and activation statistics are *not* shared: the
sequential pipeline gathers each layer's statistics on the outputs of the already-quantized earlier
layers, so they differ from method to method.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BitmosaicError

__all__ = [
    "CompareConfig", "check_compare_out", "parse_configs", "run_compare", "collect_rows", "write_reports",
    "disk_use",
]  # fmt: skip

_TOKEN = re.compile(r"(w\d+|gch|g-?\d+|a\d+(?:-fp8|-fp4|-e5m2)?|bpw\d+(?:\.\d+)?|sym|asym)")


@dataclass
class CompareConfig:
    name: str
    method: str
    flags: list[str] = field(default_factory=list)

    @property
    def slug(self) -> str:
        # a plain file name: no folder part, no "." or ".." naming OUT/models itself or its parent
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.name).strip("._") or self.method


def _setting_flags(setting: str, where: str) -> list[str]:
    flags: list[str] = []
    wbits = abits = None
    pos = 0
    s = setting.lower()
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m:
            raise BitmosaicError(
                f"config {where!r}: cannot read {setting[pos:]!r}; settings are w<bits> g<group>|gch "
                "a<bits>[-fp8|-fp4] bpw<x> sym|asym, e.g. w4g128 or w4a8"
            )
        tok = m.group(0)
        pos = m.end()
        if tok[0] == "w":
            wbits = tok[1:]
        elif tok == "gch":
            flags += ["--group-size", "-1"]
        elif tok[0] == "g":
            flags += ["--group-size", tok[1:]]
        elif tok[0] == "a":
            abits = tok[1:]
        elif tok.startswith("bpw"):
            flags += ["--bpw", tok[3:]]
        else:
            flags.append(f"--{tok}")
    if abits is not None:
        if wbits is None:
            raise BitmosaicError(f"config {where!r}: a<bits> needs the weight bits too, e.g. w4a8")
        flags += ["--scheme", f"W{wbits}A{abits.upper()}"]
    elif wbits is not None:
        flags += ["--bits", wbits]
    return flags


def _option_flags(options: dict, where: str) -> list[str]:
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or value is None:
            flags.append(flag)
        elif value is False:
            continue
        elif isinstance(value, dict | list):
            raise BitmosaicError(f"config {where!r}: option {key!r} must be a single value")
        else:
            flags += [flag, str(value)]
    return flags


def _parse_one(text: str) -> CompareConfig:
    text = text.strip()
    method, sep, rest = text.partition(":")
    if not method or not re.fullmatch(r"[A-Za-z0-9_-]+", method):
        raise BitmosaicError(f"config {text!r}: expected method:setting, e.g. gptq:w3g128")
    parts = [p.strip() for p in rest.split(";")] if sep else []
    flags = _setting_flags(parts[0], text) if parts and parts[0] else []
    for extra in parts[1:]:
        if not extra:
            continue
        key, eq, value = extra.partition("=")
        flags += _option_flags({key.strip(): value.strip() if eq else True}, text)
    return CompareConfig(text, method, ["--method", method, *flags])


def parse_configs(spec: str) -> list[CompareConfig]:
    """Configs from a comma list (module doc) or from a JSON/YAML file holding a list of mappings."""
    path = Path(spec)
    try:
        is_file = path.is_file()
    except OSError:  # a long comma list is no valid path (ENAMETOOLONG)
        is_file = False
    if is_file or ("," not in spec and path.suffix.lower() in (".json", ".yaml", ".yml")):
        if not path.is_file():
            raise BitmosaicError(f"--configs {spec}: no such file")
        text = path.read_text(encoding="utf-8")
        try:
            if path.suffix.lower() == ".json":
                items = json.loads(text)
            else:
                import yaml

                items = yaml.safe_load(text)
        except Exception as e:  # JSON/YAML syntax errors of both libraries: one line naming the file
            raise BitmosaicError(f"--configs {spec}: not valid JSON/YAML ({type(e).__name__})") from None
        if not isinstance(items, list) or not all(isinstance(i, dict) and "method" in i for i in items):
            raise BitmosaicError(f"--configs {spec}: expected a list of mappings, each with a 'method'")
        configs = []
        for i, item in enumerate(items):
            opts = {k: v for k, v in item.items() if k not in ("name", "method")}
            name = str(item.get("name") or f"{item['method']}#{i}")
            flags = ["--method", str(item["method"]), *_option_flags(opts, name)]
            configs.append(CompareConfig(name, str(item["method"]), flags))
    else:
        configs = [_parse_one(t) for t in spec.split(",") if t.strip()]
    if not configs:
        raise BitmosaicError("--configs is empty; e.g. \"rtn:w4g128, gptq:w3g128\"")
    slugs = [c.slug for c in configs]
    dup = sorted({s for s in slugs if slugs.count(s) > 1})
    if dup:
        raise BitmosaicError(f"--configs names {dup} more than once; give each config a distinct name")
    return configs


MARKER = "compare.json"  # written first into every compare folder: what it compares
_OWN_NAMES = {"runs", "logs", "models", "failures.json", "results.csv", "results.json", "results.md",
              "pareto.png", MARKER}  # fmt: skip


def check_compare_out(out: str | Path) -> Path:
    """``out`` resolved, if ``bitmosaic compare`` may write there: a new or empty folder, or one that
    compare wrote (it holds ``compare.json``; a folder from a bitmosaic before that marker holds
    ``runs/`` and nothing but the names compare writes).  Anything else is a one-line
    :class:`~bitmosaic.errors.OutputExistsError`: compare rewrites ``results.*`` and ``pareto.png``."""
    from ..errors import OutputExistsError

    out = Path(out).expanduser().resolve()
    if not out.exists():
        return out
    if not out.is_dir():
        raise OutputExistsError(f"--out {out} exists and is not a folder; choose another --out")
    names = {p.name for p in out.iterdir()}
    if not names or MARKER in names or ("runs" in names and (out / "runs").is_dir() and names <= _OWN_NAMES):
        return out
    raise OutputExistsError(
        f"--out {out} is not empty and is not a bitmosaic compare folder (no {MARKER}); compare would "
        "overwrite its results.csv/results.md: choose a new or empty --out"
    )


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def _run(cmd: list[str], log: Path) -> int:
    """Run one config's command (output to ``log``) in its own process group; when compare itself is
    stopped (SIGINT, SIGTERM: an exception here), the group is stopped too (:func:`_stop`), so no
    orphan keeps writing."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to ``proc``'s process group (bitmosaic then removes its temporaries and exits 143);
    SIGKILL when it has not ended after ``grace`` seconds, or when compare is interrupted again."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        pass
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run_config(cmd: list[str], log: Path, partial: Path) -> int:
    """:func:`_run`; an interrupted run's unfinished ``partial`` result is removed."""
    try:
        return _run(cmd, log)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _last_error(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs or lines or ["(no output)"])[-1][:300]


def run_compare(
    model: str,
    configs: list[CompareConfig],
    common: list[str],
    out: str | Path,
    *,
    eval_flags: list[str],
    progress: bool = True,
    python: str = sys.executable,
    keep_models: bool = True,
) -> Path:
    """Run every config not finished yet (module doc), then write the reports; returns ``out``.
    ``keep_models=False``: each saved model is measured (its size goes in the table) and deleted."""
    from tqdm.auto import tqdm

    out = check_compare_out(out)
    for sub in ("runs", "logs", "models"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        _atomic_json(out / MARKER, {"model": model, "configs": [c.name for c in configs]})
    cli = [python, "-m", "bitmosaic.cli"]
    float_json = out / "runs" / "float.json"
    todo = [c for c in configs if not (out / "runs" / f"{c.slug}.json").is_file()]
    bar = tqdm(total=len(todo) + (not float_json.is_file()), desc="compare", unit="config",
               disable=not progress, dynamic_ncols=True)  # fmt: skip
    failures: dict[str, str] = {}
    with bar:
        if not float_json.is_file():
            bar.set_postfix_str("float")
            tmp = out / "runs" / "float.json.partial"
            cmd = [*cli, "eval", model, *eval_flags, "--no-progress", "--json", str(tmp)]
            if _run_config(cmd, out / "logs" / "float.log", tmp) == 0:
                tmp.replace(float_json)
            else:
                failures["float"] = _last_error(out / "logs" / "float.log")
            bar.update(1)
        for c in todo:
            bar.set_postfix_str(c.name)
            tmp = out / "runs" / f"{c.slug}.json.partial"
            cmd = [*cli, "quantize", "--model", model, *c.flags, *common, "--fidelity", "--no-progress",
                   "--json", str(tmp), "--out", str(out / "models" / c.slug), "--overwrite"]  # fmt: skip
            t0 = time.perf_counter()
            rc = _run_config(cmd, out / "logs" / f"{c.slug}.log", tmp)
            if rc == 0:
                rec = json.loads(tmp.read_text())
                saved = out / "models" / c.slug
                rec["compare"] = {"name": c.name, "method": c.method, "flags": c.flags,
                                  "wall_seconds": time.perf_counter() - t0,
                                  "size_bytes": _dir_bytes(saved), "model_kept": keep_models}  # fmt: skip
                _atomic_json(out / "runs" / f"{c.slug}.json", rec)
                tmp.unlink()
                if not keep_models:
                    shutil.rmtree(saved, ignore_errors=True)
            else:
                failures[c.name] = _last_error(out / "logs" / f"{c.slug}.log")
            bar.update(1)
    _atomic_json(out / "failures.json", failures)
    write_reports(collect_rows(out, configs), out)
    return out


def disk_use(out: str | Path) -> int:
    """Bytes of every file under a compare folder (the saved models are most of it)."""
    return sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.safetensors")) if path.is_dir() else 0


def collect_rows(out: str | Path, configs: list[CompareConfig] | None = None) -> list[dict]:
    """One row per finished run under ``out/runs`` (the float model first), in ``configs`` order."""
    out = Path(out)
    rows: list[dict] = []
    fj = out / "runs" / "float.json"
    if fj.is_file():
        f = json.loads(fj.read_text())
        rows.append({"name": "float", "method": "float", "setting": "", "bits_per_weight": None,
                     "size_mb": None, "ppl": f["ppl"], "kl_mean": 0.0, "kl_p99": 0.0,
                     "top1_agreement": 1.0, "tasks": f.get("tasks", {}), "quant_seconds": None,
                     "peak_rss_mb": None, "cache_hits": ""})  # fmt: skip
    names = [c.slug for c in configs] if configs else sorted(
        p.stem for p in (out / "runs").glob("*.json") if p.stem != "float"
    )
    for slug in names:
        p = out / "runs" / f"{slug}.json"
        if not p.is_file():
            continue
        r = json.loads(p.read_text())
        q = r.get("eval", {}).get("quantized", {})
        meta = r.get("compare", {})
        name = meta.get("name", slug)
        rows.append({
            "name": name,
            "method": meta.get("method", r.get("method", "?")),
            "setting": name.partition(":")[2],
            "bits_per_weight": r.get("bits_per_weight"),
            "size_mb": meta.get("size_bytes", _dir_bytes(out / "models" / slug)) / 2**20,
            "ppl": q.get("ppl"),
            "kl_mean": q.get("kl_mean"),
            "kl_p99": q.get("kl_p99"),
            "top1_agreement": q.get("top1_agreement"),
            "tasks": r.get("tasks", {}),
            "quant_seconds": r.get("seconds"),
            "peak_rss_mb": r.get("peak_rss_mb"),
            "cache_hits": " ".join((r.get("calibration") or {}).get("cache", {}).get("hits", [])),
        })  # fmt: skip
    return rows


_COLS = ["name", "method", "bits_per_weight", "size_mb", "ppl", "kl_mean", "kl_p99", "top1_agreement",
         "quant_seconds", "peak_rss_mb", "cache_hits"]  # fmt: skip


def _task_cols(rows: list[dict]) -> list[str]:
    return sorted({f"{t}:{m}" for r in rows for t, ms in r["tasks"].items() for m in ms
                   if m in ("acc", "acc_norm", "perplexity")})  # fmt: skip


def _cell(v) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_reports(rows: list[dict], out: str | Path) -> None:
    """``results.csv``, ``results.json``, ``results.md`` and ``pareto.png`` (when anything finished)."""
    from .plots import pareto_plot

    out = Path(out)
    tcols = _task_cols(rows)

    def flat(r):
        d = {k: r[k] for k in _COLS}
        for tc in tcols:
            t, m = tc.split(":")
            d[tc] = r["tasks"].get(t, {}).get(m)
        return d

    flat_rows = [flat(r) for r in rows]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_COLS + tcols)
    w.writeheader()
    w.writerows(flat_rows)
    (out / "results.csv").write_text(buf.getvalue())
    _atomic_json(out / "results.json", rows)
    cols = _COLS + tcols
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_cell(fr[c]) for c in cols) + " |" for fr in flat_rows]
    failures = json.loads((out / "failures.json").read_text()) if (out / "failures.json").is_file() else {}
    if failures:
        md += ["", "Failed (rerun the same command to retry them):", ""]
        md += [f"- `{k}`: {v}" for k, v in failures.items()]
    (out / "results.md").write_text("\n".join(md) + "\n")
    quant = [r for r in rows if r["method"] != "float" and r["bits_per_weight"] is not None]
    if any(r["ppl"] is not None for r in quant):
        fl = next((r["ppl"] for r in rows if r["method"] == "float"), None)
        pareto_plot(quant, out / "pareto.png", float_ppl=fl)
