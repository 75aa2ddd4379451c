"""Data-parallel calibration of mixtures of experts (issue 71; ``torchrun -m bitmosaic quantize``): 2 gloo
processes give the saved bytes of one process -- a tiny Qwen3-MoE with experts below ``--moe-min-tokens``
(pooled fallback), a tiny Mixtral under ``--moe-calib all``, a Qwen3-MoE whose expert groups are cut into
parts by ``max_memory`` (API) -- and the same rows per expert and fallbacks in the report; every rank ends
with the same codes."""

import contextlib
import json
import os

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.cli import main
from bitmosaic.pipeline.distributed import Dist
from bitmosaic.pipeline.experts import _decode, _encode
from bitmosaic.testing import save_hf_dir, tiny_moe, words
from tests.helpers import free_ports, quantized_codes

WIDE = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 128}  # g128 is one group
FLAGS = ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "128", "--nsamples", "7",
         "--seqlen", "32", "--batch-size", "2", "--no-progress", "--no-cache"]  # fmt: skip
MIN_TOKENS = 100  # 224 tokens, top-2 of 4: about 112 rows per expert, some below
CASES = {  # name: (model type, extra flags)
    "qwen3-pooled": ("qwen3_moe", ["--moe-min-tokens", str(MIN_TOKENS)]),
    "mixtral-all": ("mixtral", ["--moe-calib", "all"]),
}
# the API run: 2 experts a part (experts.py's expert_parts), the thin ones on the pool's Hessian
PARTS = {"bits": 4, "group_size": 128, "moe_min_tokens": MIN_TOKENS, "max_memory": 600_000}


def _model(model_type: str):
    opts = {k: v for k, v in WIDE.items() if not (model_type == "mixtral" and k == "moe_intermediate_size")}
    return tiny_moe(model_type, **opts)


def _calib() -> torch.Tensor:  # 7 samples in batches of 2: 4 batches, the last one short
    return torch.randint(4, 128, (7, 32), generator=torch.Generator().manual_seed(0))


def _cli(tmp: str, case: str, tag: str) -> list[str]:
    model_type, extra = CASES[case]
    out = os.path.join(tmp, f"{case}-{tag}")
    return [*FLAGS, *extra, "--model", os.path.join(tmp, model_type), "--calib",
            os.path.join(tmp, "calib.txt"), "--out", out, "--json", f"{out}.json"]  # fmt: skip



def _expert_rows(layers: list[dict]) -> dict[str, tuple]:
    return {r["name"]: (r["expert_tokens"], r.get("expert_fallback")) for r in layers if "expert_tokens" in r}



def _worker(rank: int, world: int, ports: list[int], tmp: str) -> None:
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    for case, port in zip(CASES, ports, strict=False):  # each group on its own port
        os.environ["MASTER_PORT"] = str(port)
        assert main(_cli(tmp, case, "dp")) == 0
    os.environ["MASTER_PORT"] = str(ports[-1])
    torch.distributed.init_process_group("gloo")
    try:
        model = _model("qwen3_moe")
        report = quantize_(model, "gptq", _calib(), batch_size=2, progress=False, **PARTS)
        got = {"codes": quantized_codes(model), "rows": _expert_rows(report.layers)}
        torch.save(got, os.path.join(tmp, f"api{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpmoe")
    for model_type in {t for t, _ in CASES.values()}:
        save_hf_dir(tmp / model_type, _model(model_type))
    (tmp / "calib.txt").write_text(words(4000))
    torch.multiprocessing.spawn(_worker, args=(2, free_ports(len(CASES) + 1), str(tmp)), nprocs=2, join=True)
    return tmp


@contextlib.contextmanager
def _one_thread():
    """The reference run on one thread, as each rank runs (the comparison is of processes, not of BLAS
    thread counts)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_save_the_bytes_of_one(runs, case, capsys):
    with _one_thread():
        assert main(_cli(str(runs), case, "one")) == 0
    capsys.readouterr()
    one, dp = _files(runs / f"{case}-one"), _files(runs / f"{case}-dp")
    assert "model.safetensors" in one and one.keys() == dp.keys()
    assert not [n for n in one if one[n] != dp[n]]  # the saved model, bit for bit
    a, b = (json.loads((runs / f"{case}-{t}.json").read_text()) for t in ("one", "dp"))
    rows = _expert_rows(a["layers"])
    assert len(rows) == 2 * 4 * 3 and rows == _expert_rows(b["layers"])  # 2 layers x 4 experts x 3
    assert a["calibration"]["experts"] == b["calibration"]["experts"]
    assert b["calibration"]["distributed"]["samples_per_rank"] == [4, 3]
    fell = [n for n, (_, rule) in rows.items() if rule]
    if case == "qwen3-pooled":  # some experts below --moe-min-tokens, others not
        assert 0 < len(fell) < len(rows) and {rows[n][1] for n in fell} == {"pooled"}
    else:  # every token through every expert: none thin
        assert not fell and {t for t, _ in rows.values()} == {7 * 32}


def test_expert_groups_in_parts_match_one_process_on_every_rank(runs):
    r0, r1 = (torch.load(runs / f"api{r}.pt") for r in (0, 1))
    model = _model("qwen3_moe")
    with _one_thread():
        report = quantize_(model, "gptq", _calib(), batch_size=2, progress=False, **PARTS)
    one = quantized_codes(model)
    assert len(one) == 2 * (4 * 3 + 4) and r0["codes"].keys() == one.keys()
    for n in one:
        assert torch.equal(r0["codes"][n], one[n]) and torch.equal(r1["codes"][n], one[n]), n
    rows = _expert_rows(report.layers)
    assert r0["rows"] == rows == r1["rows"] and any(rule for _, rule in rows.values())


@pytest.mark.parametrize("world", [2, 3])
def test_offset_block_rows_are_each_dealt_once(world):
    from bitmosaic.algorithms.hessian import HessianAccumulator

    for n in (64, 576):
        acc = HessianAccumulator(n)
        for offset in range(4):
            mine = [Dist(rank=r, world=world).hessian_blocks(acc, offset) for r in range(world)]
            assert sorted(k for m in mine for k in m) == list(range(len(acc.block_starts)))
            if n == 64:  # one block row: rank ``offset mod world`` adds it
                assert mine[offset % world] == {0}


def test_an_input_read_by_every_expert_travels_once():
    x, w = torch.randn(6, 8), torch.rand(3)
    events = [("add", "e0.gate", x, None), ("share", "e0.up", "e0.gate"), ("add", "e1.gate", x, None),
              ("add", "e1.down", x[:3], w)]  # fmt: skip
    items = _encode(events)
    assert sum(t is not None for _, t in items) == 3  # x once, x[:3] and w
    back = _decode(items)
    assert [e[:2] for e in back] == [e[:2] for e in events] and back[1] == events[1]
    assert back[2][2] is x and back[3][2] is events[3][2] and back[3][3] is w
