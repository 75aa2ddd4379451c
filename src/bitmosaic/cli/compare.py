"""``bitmosaic compare``: run many configs on one model; a table, a Pareto plot, a report."""

from __future__ import annotations

import argparse

from .args import DEFAULT_MODEL, add_cache_args


def add_parser(sub) -> None:
    c = sub.add_parser(
        "compare",
        help="quantize one model with many configs; table + Pareto plot (resumable)",
        description="Each config is `method:setting[;option...]` (e.g. gptq:w3g128, rtn:w8g128, "
        "gptq:w4g128;order=natural) or a JSON/YAML file; see bitmosaic.eval.compare.",
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
    from ..eval.compare import check_compare_out, disk_use, parse_configs, run_compare
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
