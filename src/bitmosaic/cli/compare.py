"""``bitmosaic compare``: many quantization configs on one model, one table, one Pareto plot.

Configs are written ``method:setting[;option...]``, comma-separated, e.g.
``"rtn:w4g128, gptq:w3g128, gptq:w4g128;order=natural, rtn:w8a8"`` (any registered method; the
Makefile's ``compare`` target lists one config of each):

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
other files is refused, never overwritten (:func:`~bitmosaic.eval.compare.check_compare_out`; the
folder, its table and plot: :mod:`bitmosaic.eval.compare`).

What is shared between configs: the float model's evaluation, the calibration samples (the same
``--seed`` draws the same samples) and, through one calibration cache folder passed to every config
(:mod:`bitmosaic.pipeline.calib_cache`), the statistics of the *float* model: the inputs of the first
decoder layer, layer 0's smoothing statistics and the Fisher salience of a global bit allocation.
The column ``cache_hits`` says which each config found there.  Other Hessians and activation
statistics are *not* shared: the sequential pipeline gathers each layer's statistics on the outputs
of the already-quantized earlier layers, so they differ from method to method.
"""

from __future__ import annotations

import argparse
import contextlib
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
from ..eval.compare import (
    MARKER,
    check_compare_out,
    collect_rows,
    disk_use,
    models_bytes,
    write_json_atomic,
    write_reports,
)
from .args import DEFAULT_MODEL, add_cache_args

__all__ = ["CompareConfig", "add_parser", "cmd_compare", "parse_configs", "run_compare"]

_TOKEN = re.compile(r"(w\d+|gch|g-?\d+|a\d+(?:-fp8|-fp4|-e5m2)?|bpw\d+(?:\.\d+)?|sym|asym)")


@dataclass
class CompareConfig:
    """One config of a comparison: its ``name`` (as written), its ``method`` and the ``bitmosaic quantize``
    flags it stands for."""

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
        write_json_atomic(out / MARKER, {"model": model, "configs": [c.name for c in configs]})
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
                                  "size_bytes": models_bytes(saved), "model_kept": keep_models}  # fmt: skip
                write_json_atomic(out / "runs" / f"{c.slug}.json", rec)
                tmp.unlink()
                if not keep_models:
                    shutil.rmtree(saved, ignore_errors=True)
            else:
                failures[c.name] = _last_error(out / "logs" / f"{c.slug}.log")
            bar.update(1)
    write_json_atomic(out / "failures.json", failures)
    write_reports(collect_rows(out, configs), out)
    return out


def add_parser(sub) -> None:
    c = sub.add_parser(
        "compare",
        help="quantize one model with many configs; table + Pareto plot (resumable)",
        description="Each config is `method:setting[;option...]` (e.g. gptq:w3g128, rtn:w8g128, "
        "gptq:w4g128;order=natural) or a JSON/YAML file; see bitmosaic.cli.compare.",
    )
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("--configs", required=True, help='"rtn:w4g128, gptq:w3g128, ..." or a JSON/YAML file')
    c.add_argument("--out", required=True, help="results folder (rerunning resumes it)")
    c.add_argument("--calib", default="wikitext2")
    c.add_argument("--nsamples", type=int, default=32)
    c.add_argument("--seqlen", type=int, default=512)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--eval", dest="eval_src", default="wikitext2")
    c.add_argument("--eval-seqlen", type=int, default=512)
    c.add_argument("--max-windows", type=int, default=None)
    c.add_argument("--data-dir", default=None)
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--tasks", default=None, help="lm-eval tasks for every config (as for quantize)")
    c.add_argument("--tasks-limit", type=float, default=None)
    c.add_argument("--tasks-dir", default=None)
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument(
        "--keep-models", action=argparse.BooleanOptionalAction, default=True,
        help="keep each config's saved model under OUT/models (default; a few MB to GBs each); "
        "--no-keep-models keeps only the table, the plot and the run records",
    )  # fmt: skip
    add_cache_args(c)  # one cache folder for every config, so they share the float-model statistics


def _shared(args, names: list[tuple[str, str]]) -> list[str]:
    flags: list[str] = []
    for attr, flag in names:
        v = getattr(args, attr)
        if v is not None:
            flags += [flag, str(v)]
    return flags


def cmd_compare(args: argparse.Namespace) -> int:
    from ..pipeline.calib_cache import default_cache_root
    from .checks import check_counts

    check_counts(args)
    check_compare_out(args.out)  # a folder of other files is refused before any run
    configs = parse_configs(args.configs)
    both = [("data_dir", "--data-dir"), ("threads", "--threads"), ("tasks", "--tasks"),
            ("tasks_limit", "--tasks-limit"), ("tasks_dir", "--tasks-dir"), ("device", "--device"),
            ("dtype", "--dtype")]  # fmt: skip
    common = _shared(args, [("calib", "--calib"), ("nsamples", "--nsamples"), ("seqlen", "--seqlen"),
                            ("seed", "--seed"), ("eval_src", "--eval"), ("eval_seqlen", "--eval-seqlen"),
                            ("max_windows", "--max-windows"), *both])  # fmt: skip
    cache_dir = str(args.cache_dir or default_cache_root())
    common += ["--no-cache"] if args.no_cache else ["--cache-dir", cache_dir]
    eval_flags = _shared(args, [("eval_src", "--ppl"), ("eval_seqlen", "--seqlen"),
                                ("max_windows", "--max-windows"), *both])  # fmt: skip
    if args.keep_models:
        print(f"each config's model is saved under {args.out}/models (--no-keep-models: only the table)")
    out = run_compare(args.model, configs, common, args.out, eval_flags=eval_flags,
                      progress=not args.no_progress, keep_models=args.keep_models)  # fmt: skip
    print((out / "results.md").read_text())
    print(f"table: {out / 'results.csv'}; plot: {out / 'pareto.png'}")
    print(f"disk: {disk_use(out) / 2**20:.1f} MiB in {out}")
    failed = (out / "failures.json").read_text().strip() not in ("{}", "")
    return 1 if failed else 0
