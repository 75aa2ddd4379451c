"""Calibration activations spilled to disk (``bitmosaic.pipeline.spill``): the spill store, the streamed
tensor file, sizes and the spill decision."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from bitmosaic.errors import OptionError
from bitmosaic.pipeline import spill as S
from bitmosaic.pipeline.spill import SpillStore, TensorFile, parse_size, write_tensor_file

# --- the store and the file format ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_spill_store_gives_back_the_bytes_written_one_generation_at_a_time(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    first = [torch.randn(n, 5, 8, generator=g).to(dtype) for n in (4, 4, 2)]
    s = SpillStore(tmp_path)
    assert s.dir.parent == tmp_path and s.dir.name.startswith(S.SPILL_PREFIX)
    for t in first:
        s.append(t)
    assert len(s) == 3 and all(torch.equal(s.read(i), first[i]) for i in (2, 0, 1))
    nxt = [t * 2 for t in first]
    for i in (1, 0, 2):  # any order; batch i of this generation stays readable until advance()
        assert torch.equal(s.read(i), first[i])
        s.write(i, nxt[i])
    assert sorted(p.name for p in s.dir.iterdir()) == ["activations-00000.bin", "activations-00001.bin"]
    s.advance()
    assert [p.name for p in s.dir.iterdir()] == ["activations-00001.bin"]  # the old generation is gone
    assert all(torch.equal(s.read(i), nxt[i]) and s.read(i).dtype == dtype for i in range(3))
    assert s.nbytes() == sum(t.numel() * t.element_size() for t in nxt)
    with pytest.raises(RuntimeError, match="only 1 of 3"):
        s.write(0, nxt[0])
        s.advance()
    s.close()
    s.close()  # idempotent
    assert not s.dir.exists()


def test_a_streamed_tensor_file_is_a_safetensors_file_both_ways(tmp_path):
    g = torch.Generator().manual_seed(1)
    ts = {"b0": torch.randn(3, 4, generator=g).bfloat16(), "b1": torch.randn(2, 4, generator=g),
          "gen_state": torch.Generator().manual_seed(3).get_state()}  # fmt: skip
    names = list(ts)
    write_tensor_file(tmp_path / "a.safetensors", [(n, tuple(ts[n].shape), ts[n].dtype) for n in names],
                      lambda i: ts[names[i]], {"format": "pt"})  # fmt: skip
    back = load_file(str(tmp_path / "a.safetensors"))  # safetensors reads ours
    assert sorted(back) == sorted(ts) and all(torch.equal(back[n], ts[n]) for n in ts)
    save_file(ts, str(tmp_path / "b.safetensors"))  # and we read safetensors'
    with TensorFile(tmp_path / "b.safetensors") as f:
        assert sorted(f.keys()) == sorted(ts) and all(torch.equal(f.get(n), ts[n]) for n in ts)
    with pytest.raises(ValueError, match="announced"):
        write_tensor_file(tmp_path / "c.safetensors", [("x", (2,), torch.float32)], lambda i: torch.zeros(3))


def test_parse_size():
    assert parse_size("8GB") == 8 * 2**30 and parse_size("8gib") == parse_size("8G") == 8 * 2**30
    assert parse_size("512MB") == 512 * 2**20 and parse_size("1.5TB") == int(1.5 * 2**40)
    assert parse_size("100B") == 100 and parse_size(4096) == 4096 and parse_size(" 2 kb ") == 2048
    assert parse_size(None) is None and parse_size("auto") is None
    for bad, needle in [("8", "unit"), ("8XB", "unit"), ("lots", "unit"), ("-1GB", "unit"),
                        ("0MB", "more than 0"), (0, "more than 0"), (1.5, "not a size"),
                        (True, "not a size")]:  # fmt: skip
        with pytest.raises(OptionError, match=needle) as e:
            parse_size(bad)
        assert "\n" not in str(e.value)


def test_the_decision_compares_inputs_and_outputs_with_40_percent_of_the_budget():
    need = 2 * 1000 * 64 * 2  # 1000 tokens x 64 values in bf16, in and out
    at = S.spill_decision(1000, 64, torch.bfloat16, int(need / S.SPILL_FRACTION), host=True)
    assert not at["spilled"] and at["budget_from"] == "max_memory"
    assert S.spill_decision(1000, 64, torch.bfloat16, int(need / S.SPILL_FRACTION) - 1, host=True)["spilled"]
    assert not S.spill_decision(1000, 64, torch.bfloat16, 1, host=False)["spilled"]  # on a GPU
    auto = S.spill_decision(1000, 64, torch.bfloat16, None, host=True)
    assert auto["budget_from"] == "MemAvailable" and auto["budget_mb"] > 0 and not auto["spilled"]
