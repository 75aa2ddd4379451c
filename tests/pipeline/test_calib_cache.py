"""The calibration statistics cache: bit-identical results from cache, keys, damaged entries, the cap,
Fisher's unified key, and the CLI / compare plumbing (tiny random Llama)."""

import json
import warnings

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.pipeline.calib_cache import CalibCache, cache_key, default_cache_root, read_entry, write_entry
from tests.pipeline.test_pipeline import tiny_llama


def _calib(n=6, seqlen=32, seed=0):
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _run(method, opts, cache=None, calib=None, **kw):
    m = tiny_llama()
    rep = quantize_(m, method, _calib() if calib is None else calib, progress=False, calib_cache=cache,
                    **opts, **kw)  # fmt: skip
    return m.state_dict(), rep


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"differ: {diff[:4]}"


_SFMP = {"avg_bits": 2.5, "group_size": 16, "block_rows": 8, "n_grid": 4}


@pytest.mark.parametrize(
    "method, opts, kinds",
    [
        ("gptq", {"bits": 3, "group_size": 32}, ["inputs"]),
        ("mosaic", {}, ["inputs", "captures"]),  # the transform reads layer 0's token sample
        ("sfmp", _SFMP, ["inputs", "fisher", "captures"]),
    ],
)
def test_second_run_comes_from_the_cache_bit_for_bit(tmp_path, method, opts, kinds):
    first, rep1 = _run(method, opts, CalibCache(tmp_path))
    second, rep2 = _run(method, opts, CalibCache(tmp_path))
    c1, c2 = rep1.calibration["cache"], rep2.calibration["cache"]
    assert c1["hits"] == [] and sorted(c1["misses"]) == sorted(kinds)
    assert c2["hits"] == kinds and c2["misses"] == []
    _assert_identical(first, second)
    assert sorted(p.parent.name for p in tmp_path.glob("*/*.safetensors")) == sorted(kinds)


def test_methods_share_the_float_statistics(tmp_path):
    """SmoothQuant fills the cache; SQ-format (which smooths first, with the same token sample size)
    then finds layer 0's inputs and group statistics there.  (Transforms with another ``max_tokens``,
    e.g. AWQ's 256, share only the inputs: the sample is part of the captured statistics.)"""
    _run("smoothquant", {}, CalibCache(tmp_path))
    plain, _ = _run("sq-weights", {})
    shared, rep = _run("sq-weights", {}, CalibCache(tmp_path))
    assert rep.calibration["cache"]["hits"] == ["inputs", "captures"]
    _assert_identical(plain, shared)
    _, rep = _run("awq", {"bits": 4, "group_size": 32}, CalibCache(tmp_path))
    assert (rep.calibration["cache"]["hits"], rep.calibration["cache"]["misses"]) == (
        ["inputs"],
        ["captures"],
    )
    _, rep = _run("smoothquant", {}, CalibCache(tmp_path), seed=1)  # another token sample
    assert (rep.calibration["cache"]["hits"], rep.calibration["cache"]["misses"]) == (
        ["inputs"],
        ["captures"],
    )


def test_key_follows_tokens_settings_and_weights(tmp_path):
    cache = CalibCache(tmp_path)
    _run("gptq", {"bits": 4}, cache)
    for change in ({"calib": _calib(seed=1)}, {"calib": _calib(n=4)}, {"batch_size": 2}):
        _, rep = _run("gptq", {"bits": 4}, CalibCache(tmp_path), **change)
        assert rep.calibration["cache"]["hits"] == [], change
    m = tiny_llama()
    with torch.no_grad():
        m.model.embed_tokens.weight[3, 5] += 1e-3
    rep = quantize_(m, "gptq", _calib(), bits=4, progress=False, calib_cache=CalibCache(tmp_path))
    assert rep.calibration["cache"]["hits"] == []
    _, rep = _run("gptq", {"bits": 4}, CalibCache(tmp_path))
    assert rep.calibration["cache"]["hits"] == ["inputs"]


def _flip_last_byte(p):
    b = bytearray(p.read_bytes())
    b[-1] ^= 0xFF
    p.write_bytes(bytes(b))


def test_damaged_entries_are_recomputed_with_one_warning(tmp_path):
    opts = {"bits": 4, "group_size": 32}
    good, _ = _run("awq", opts, CalibCache(tmp_path))
    for p in tmp_path.glob("*/*.safetensors"):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # a partial file
    cache = CalibCache(tmp_path)
    with pytest.warns(UserWarning, match="is damaged") as rec:
        again, rep = _run("awq", opts, cache)
    assert len([w for w in rec if "calibration cache" in str(w.message)]) == 2  # one per entry
    assert rep.calibration["cache"]["corrupt"] == ["inputs", "captures"]
    _assert_identical(good, again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, rep = _run("awq", opts, CalibCache(tmp_path))  # rewritten: hits, no warning
    assert rep.calibration["cache"]["hits"] == ["inputs", "captures"]


@pytest.mark.parametrize(
    "damage",
    [
        _flip_last_byte,  # a bit flip in the data: only the checksum sees it
        lambda p: p.write_bytes(b"not a safetensors file"),
        lambda p: p.write_bytes(b""),
    ],
)
def test_every_kind_of_damage_is_a_miss_never_a_crash(tmp_path, damage):
    cache = CalibCache(tmp_path)
    key = "ab" * 12
    assert cache.store("inputs", key, {"first": [torch.randn(2, 3)], "kwargs": {}})
    damage(cache.path("inputs", key))
    with pytest.warns(UserWarning, match="is damaged"):
        assert cache.load("inputs", key) is None
    assert cache.corrupt == ["inputs"] and not cache.path("inputs", key).exists()
    assert cache.load("inputs", key) is None and cache.misses == ["inputs", "inputs"]


def test_entry_round_trip_keeps_structure_dtypes_and_sharing(tmp_path):
    shared = torch.randn(3, 4)
    value = {"a": [shared, (shared, None, True, 2, 0.5, "s")], "b": torch.randn(5).bfloat16(),
             "c": torch.arange(6).reshape(2, 3), "d": {}}  # fmt: skip
    write_entry(tmp_path / "e.safetensors", value)
    got = read_entry(tmp_path / "e.safetensors")
    assert got["a"][0] is got["a"][1][0] and torch.equal(got["a"][0], shared)
    assert got["a"][1][1:] == (None, True, 2, 0.5, "s") and isinstance(got["a"][1], tuple)
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], value["b"])
    assert torch.equal(got["c"], value["c"]) and got["d"] == {}
    assert list(tmp_path.iterdir()) == [tmp_path / "e.safetensors"]  # no temporary file left


def test_unstorable_values_are_not_cached(tmp_path):
    cache = CalibCache(tmp_path)
    with pytest.warns(UserWarning, match="not cached"):
        assert not cache.store("inputs", "0" * 24, {"x": object()})
    assert not list(tmp_path.rglob("*.safetensors"))


def test_an_unwritable_cache_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="cannot write"):
        _, rep = _run("gptq", {"bits": 4, "group_size": 32}, CalibCache(blocker))
    assert rep.calibration["cache"]["misses"] == ["inputs"]
    monkeypatch.setenv("BITMOSAIC_CACHE_MAX_GB", "lots")
    with pytest.raises(ValueError, match="BITMOSAIC_CACHE_MAX_GB"):
        CalibCache(tmp_path)


def test_size_cap_evicts_least_recently_used_entries_only(tmp_path):
    import os

    cache = CalibCache(tmp_path, max_gb=3e3 / 2**30)  # room for two 1.3 kB entries
    other = tmp_path / "inputs" / "notes.safetensors"  # not an entry's name: never deleted
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x" * 10)
    keys = [f"{i:024x}" for i in range(4)]
    stale, fresh = (
        other.parent / f"{'f' * 24}.safetensors.tmp1",
        other.parent / f"{'e' * 24}.safetensors.tmp2",
    )
    for p in (stale, fresh):
        p.write_bytes(b"partial")
    os.utime(stale, (0, 0))  # a writer killed long ago
    for t, k in enumerate(keys):
        cache.store("inputs", k, {"x": torch.zeros(256)})
        os.utime(cache.path("inputs", k), (t, t))  # distinct, increasing use times
    left = sorted(p.name for p in (tmp_path / "inputs").iterdir())
    assert left == sorted(
        [f"{keys[2]}.safetensors", f"{keys[3]}.safetensors", "notes.safetensors", fresh.name]
    )


def test_disabled_cache_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("BITMOSAIC_CACHE", str(tmp_path))
    plain, _ = _run("sfmp", {**_SFMP, "fisher_cache": None})
    off, rep = _run("sfmp", _SFMP, CalibCache(None))
    _assert_identical(plain, off)
    assert rep.calibration["cache"]["hits"] == [] and not list(tmp_path.rglob("*"))


def test_fisher_key_is_unchanged_and_old_entries_still_load(tmp_path):
    """Entries the Fisher cache wrote before the unified module (a flat safetensors file under the
    same key) are still found."""
    from safetensors.torch import save_file

    from bitmosaic.pipeline.fisher import fisher_salience, salience_linear_names

    model = tiny_llama()
    calib = _calib(2, 12)
    names = salience_linear_names(model)
    weights = [(n, model.get_submodule(n).weight) for n in names]
    key = cache_key(model, calib, weights, 1)
    fake = {n: torch.full(model.get_submodule(n).weight.shape, 7.0) for n in names}
    save_file(fake, str(tmp_path / f"{key}.safetensors"))  # as the old fisher.py wrote it
    sal, info = fisher_salience(model, calib, names, cache_dir=tmp_path, progress=False)
    assert info["cached"] and info["key"] == key and torch.equal(sal[names[0]], fake[names[0]])


def test_cli_quantize_uses_the_cache_dir_and_no_cache(tmp_path):
    from bitmosaic.cli import main
    from tests.helpers import save_hf_dir, words

    model = save_hf_dir(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text(words(3000))
    cache = tmp_path / "cache"
    argv = ["quantize", "--model", str(model), "--method", "gptq", "--bits", "4", "--group-size", "32",
            "--calib", str(text), "--nsamples", "2", "--seqlen", "32", "--no-progress",
            "--cache-dir", str(cache)]  # fmt: skip
    for i in range(2):
        assert main([*argv, "--json", str(tmp_path / f"r{i}.json")]) == 0
    reps = [json.loads((tmp_path / f"r{i}.json").read_text())["calibration"]["cache"] for i in range(2)]
    assert reps[0]["misses"] == ["inputs"] and reps[1]["hits"] == ["inputs"]
    assert main([*argv[:-2], "--no-cache", "--json", str(tmp_path / "off.json")]) == 0
    assert json.loads((tmp_path / "off.json").read_text())["calibration"]["cache"]["root"] is None


def test_compare_gives_every_config_one_cache_and_reports_hits(tmp_path, monkeypatch):
    from bitmosaic.cli import compare as cli_compare
    from bitmosaic.cli import main
    from bitmosaic.eval import compare

    seen = {}

    def fake_run_compare(model, configs, common, out, **kw):
        seen["common"] = common
        for c in configs:  # what each config's `quantize --json` would have written
            rec = {"calibration": {"cache": {"hits": ["inputs", "captures"]}}, "bits_per_weight": 4.0}
            (tmp_path / "runs").mkdir(exist_ok=True)
            (tmp_path / "runs" / f"{c.slug}.json").write_text(json.dumps(rec))
        (tmp_path / "failures.json").write_text("{}")
        compare.write_reports(compare.collect_rows(tmp_path, configs), tmp_path)
        return tmp_path

    monkeypatch.setattr(cli_compare, "run_compare", fake_run_compare)
    base = ["compare", "--configs", "awq:w4g32, awq:w3g32", "--out", str(tmp_path), "--no-progress"]
    assert main([*base, "--cache-dir", str(tmp_path / "c")]) == 0
    i = seen["common"].index("--cache-dir")
    assert seen["common"][i + 1] == str(tmp_path / "c") and "--no-cache" not in seen["common"]
    rows = compare.collect_rows(tmp_path)
    assert [r["cache_hits"] for r in rows] == ["inputs captures"] * 2
    assert "cache_hits" in (tmp_path / "results.md").read_text()
    assert main([*base, "--no-cache"]) == 0 and "--no-cache" in seen["common"]
    assert main(base) == 0  # default: the one default folder, for every config
    assert seen["common"][seen["common"].index("--cache-dir") + 1] == str(default_cache_root())
