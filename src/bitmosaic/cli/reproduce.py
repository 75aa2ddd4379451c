"""``bitmosaic reproduce DIR``: rerun the recipe a saved model records, on the data it records, and
compare every saved tensor with the new result -- bit for bit, else the largest difference per
tensor.  Exit 0 when every tensor matches, 1 when any differs (or the calibration data is not the
recorded one), 2 on bad input.

The folder's ``quantization_config`` holds ``recipe`` and ``provenance`` (model, calibration
fingerprint, device, dtype, threads, batch size, library versions; see
:mod:`bitmosaic.io.provenance`).  The run uses the recorded device and thread count unless
``--device`` / ``--threads`` say otherwise; a different torch build, device or thread count can
change float rounding, so the versions are printed side by side.
"""

from __future__ import annotations

from pathlib import Path


def add_reproduce_parser(sub) -> None:
    r = sub.add_parser("reproduce", help="rerun a saved model's recorded recipe and compare every tensor")
    r.add_argument("dir", help="a folder saved by `bitmosaic quantize --out` or quantize_ + save_quantized")
    r.add_argument(
        "--model", default=None, help="the source model, if its recorded spec does not resolve here"
    )
    r.add_argument("--data-dir", default=None, help="shared data folder (else $BITMOSAIC_DATA, else the hub)")
    r.add_argument("--device", default=None, help="default: the recorded device")
    r.add_argument("--threads", type=int, default=None, help="default: the recorded thread count")
    r.add_argument("--json", default=None, help="write the comparison here")
    r.add_argument("--no-progress", action="store_true")


def _recorded(path: Path, qc: dict):
    from ..errors import BitmosaicError
    from ..pipeline.recipe import Recipe

    recipe, prov = qc.get("recipe"), qc.get("provenance")
    if not isinstance(recipe, dict) or not isinstance(prov, dict):
        raise BitmosaicError(
            f"{path} records no recipe and provenance (saved by an older bitmosaic, or with an explicit "
            "quant_info); save it again with `bitmosaic quantize --out` or quantize_ + save_quantized"
        )
    try:
        cal, pipe = prov["calibration"], prov["pipeline"]
        cal["source"], cal["nsamples"], cal["seqlen"], cal["seed"], pipe["device"], prov["model"]
    except (KeyError, TypeError) as e:
        raise BitmosaicError(
            f"{path}/config.json: provenance lacks {e}; the folder was edited or damaged"
        ) from None
    if cal["source"] == "tensor":
        raise BitmosaicError(
            f"{path} was calibrated on token ids given from Python, which it does not hold; reproduce needs "
            "a dataset name or text file as quantize_'s calib (or calib_source=)"
        )
    return Recipe.from_dict(recipe, where=f"{path.name} recipe"), prov


def compare_state_dicts(saved: dict, new: dict) -> list[dict]:
    """Per tensor: ``{"name", "equal", "max_abs_diff"}`` (``None`` when shapes/dtypes differ or one
    side lacks it)."""
    import torch

    rows = []
    for name in sorted(set(saved) | set(new)):
        a, b = saved.get(name), new.get(name)
        if a is None or b is None:
            rows.append({"name": name, "equal": False, "max_abs_diff": None, "why": "missing on one side"})
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            why = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
            rows.append({"name": name, "equal": False, "max_abs_diff": None, "why": why})
            continue
        eq = torch.equal(_bits(a), _bits(b))  # bit for bit: -0.0 and 0.0 differ
        diff = 0.0 if eq or not a.numel() else float((a.double() - b.double()).abs().max())
        rows.append({"name": name, "equal": eq, "max_abs_diff": diff})
    return rows


def compare_layer_configs(saved: dict, new: dict) -> list[dict]:
    """Per quantized layer whose saved settings (``quantization_config.modules``) differ from the rerun's:
    ``{"name": "<layer> (settings)", "equal": False, "max_abs_diff": None, "why": ...}``.  The tensors can
    all match while an edited setting (``bits``) changes what they mean."""
    import json

    rows = []
    for name in sorted(set(saved) | set(new)):
        a, b = saved.get(name), new.get(name)
        if a is None or b is None:
            why = "not in the saved config" if a is None else "not quantized by the rerun"
        else:
            a, b = (json.loads(json.dumps(x, default=str)) for x in (a, b))  # as config.json holds them
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            if not keys:
                continue
            why = "; ".join(f"{k}: saved {a.get(k)!r}, rerun {b.get(k)!r}" for k in keys[:3])
        rows.append({"name": f"{name} (settings)", "equal": False, "max_abs_diff": None, "why": why})
    return rows


def _bits(t):
    import torch

    if not t.is_floating_point():
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def cmd_reproduce(args) -> int:
    import json

    import torch

    from ..errors import BitmosaicError
    from ..io.saved.provenance import library_versions
    from ..io.sources.loading import resolve_device
    from .checks import check_counts
    from .commands import verify_file_hashes
    from .evaluate import check_json_path, write_json

    check_counts(args)
    path = Path(args.dir)
    checked = verify_file_hashes(path)  # first: a file changed since the save is named as such
    if checked is not None:
        print(f"all {len(checked)} files match the SHA-256 recorded at save (SHA256SUMS)")
    from ..io.saved.load import verify_saved

    _, qc = verify_saved(path)  # an edited or damaged folder is refused as the loaders refuse it
    recipe, prov = _recorded(path, qc)
    if qc.get("method") == recipe.method:
        recipe, pinned = recipe.pin_recorded_defaults(qc.get("config"))
        if pinned:
            said = ", ".join(f"{k}={v}" for k, v in pinned.items())
            print(f"defaults changed since the save; the recorded values are used: {said}")
    check_json_path(args.json)
    pipe = prov["pipeline"]
    torch.set_num_threads(args.threads or int(pipe.get("threads") or torch.get_num_threads()))
    device = resolve_device(args.device or pipe["device"])
    now, rec = library_versions(), prov.get("versions") or {}
    print(f"{'library':<14} {'recorded':<22} {'now':<22}")
    for k in sorted(set(rec) | set(now)):
        mark = "" if rec.get(k) == now.get(k) else "  <- differs"
        print(f"{k:<14} {rec.get(k)!s:<22} {now.get(k)!s:<22}{mark}")
    if not (args.model or prov["model"]):
        raise BitmosaicError(f"{path} does not record its source model; pass --model")
    result: dict = {"dir": str(path), "versions": {"recorded": rec, "now": now}}
    model, diffs = _rerun(args, recipe, prov, device)
    if diffs:
        print("calibration data differs from the recorded data: " + "; ".join(diffs))
        result.update(match=False, calibration_differs=diffs)
        write_json(args.json, result)
        return 1
    bad, n_tensors = _compare(path, qc, model)
    result.update(match=not bad, tensors=n_tensors, differing=bad)
    write_json(args.json, json.loads(json.dumps(result, default=str)))
    return 0 if not bad else 1


def _rerun(args, recipe, prov: dict, device):
    """The recorded run again, on the recorded data: ``(model, [])``, or ``(None, differences)`` when
    the calibration data drawn now is not the recorded data."""
    import torch

    from ..api import draw_calibration
    from ..io import load_model
    from ..io.saved.provenance import calibration_fingerprint, compare_fingerprints
    from ..pipeline.calib_cache import CalibCache
    from ..pipeline.run import run, source_name
    from ..pipeline.settings import RunSettings

    cal, pipe = prov["calibration"], prov["pipeline"]
    spec, source, seed = args.model or prov["model"], cal["source"], int(cal["seed"])
    n, seqlen = int(cal["nsamples"]), int(cal["seqlen"])
    model, tok = load_model(spec, dtype=getattr(torch, pipe.get("dtype") or "float32"))
    calibration = draw_calibration(tok, source, n, seqlen, seed, args.data_dir)
    fp = calibration_fingerprint(calibration.tokens, source=source, seed=seed, bos=bool(cal.get("bos")))
    diffs = compare_fingerprints(cal, fp)
    if diffs:
        return None, diffs
    print(f"calibration data matches ({n} x {seqlen} tokens from {source}, seed {seed})")
    settings = RunSettings.from_record(pipe, seed=seed, device=device, progress=not args.no_progress,
                                       calib_cache=CalibCache("auto"))  # fmt: skip
    torch.manual_seed(seed)
    run(model, recipe, calibration, settings, source_model=source_name(spec))
    return model, []


def _compare(path: Path, qc: dict, model) -> tuple[list[dict], int]:
    """Every saved tensor and layer setting against the rerun's, printed: ``(differing rows, tensors)``."""
    from ..io.saved.load import read_state_dict
    from ..io.saved.save import quantized_modules, state_dict_for_save
    from ..modules.qmodules import full_layer_config

    rows = compare_state_dicts(read_state_dict(path), state_dict_for_save(model))
    n_tensors = len(rows)
    rerun = {n: full_layer_config(m) for n, m in quantized_modules(model).items()}
    rows += compare_layer_configs(qc["modules"], rerun)
    bad = [r for r in rows if not r["equal"]]
    for r in bad[:30]:
        print(
            f"DIFFERS {r['name']:<52} max |diff| {r['max_abs_diff']}"
            + (f" ({r['why']})" if "why" in r else "")
        )
    if len(bad) > 30:
        print(f"... and {len(bad) - 30} more")
    n_settings = sum(1 for r in bad if r["name"].endswith(" (settings)"))
    print(
        f"all {n_tensors} tensors match bit for bit, and so do the settings of all {len(rerun)} layers"
        if not bad
        else f"{len(bad) - n_settings} of {n_tensors} tensors and {n_settings} layer settings differ"
    )
    return bad, n_tensors
