"""Data-parallel calibration (``torchrun -m bitmosaic quantize``): 2 gloo processes on the CPU give the
codes of one process (>= 99.9% identical) and its perplexity (< 0.1% apart), every rank ends with the
same model, rank 0 alone writes; a streamed run is refused in one line."""

import contextlib
import io
import json
import os

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.algorithms.hessian import HessianAccumulator
from bitmosaic.algorithms.types import QuantResult
from bitmosaic.cli import main
from bitmosaic.errors import OptionError
from bitmosaic.eval.perplexity import perplexity
from bitmosaic.io import load_quantized
from bitmosaic.pipeline.capture import capture_groups
from bitmosaic.pipeline.distributed import Dist, current
from bitmosaic.pipeline.fisher import fisher_salience
from bitmosaic.testing import save_hf_dir, tiny_llama, words
from tests.helpers import free_ports, quantized_codes

# Python API runs in every rank: (method, options); smoothquant searches alpha on its token sample
API_RUNS = {
    "awq": {"bits": 4, "group_size": 32},
    "smoothquant": {"bits": 4, "group_size": 32, "alpha": None, "alpha_grid": (0.3, 0.5, 0.7)},
}
CLI_FLAGS = ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "32", "--nsamples", "7",
             "--seqlen", "32", "--batch-size", "2", "--no-progress", "--no-cache"]  # fmt: skip


def _calib() -> torch.Tensor:  # 7 samples in batches of 2: 4 batches, the last one short
    return torch.randint(4, 128, (7, 32), generator=torch.Generator().manual_seed(0))




def _worker(rank: int, world: int, ports: list[int], tmp: str) -> None:
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world, MASTER_PORT=ports[0])
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    out = os.path.join(tmp, "dp")
    args = [*CLI_FLAGS, "--model", os.path.join(tmp, "model"), "--calib", os.path.join(tmp, "calib.txt"),
            "--out", out, "--json", os.path.join(tmp, "dp.json")]  # fmt: skip
    assert main(args) == 0  # starts and ends its own process group (init_from_env)
    os.environ["MASTER_PORT"] = str(ports[1])  # each group on its own port: rank 0's last store may be up
    err = io.StringIO()
    stream = [*CLI_FLAGS, "--model", os.path.join(tmp, "model"), "--calib", os.path.join(tmp, "calib.txt"),
              "--out", os.path.join(tmp, "st"), "--stream", "on"]  # fmt: skip
    with contextlib.redirect_stderr(err):
        code = main(stream)
    os.environ["MASTER_PORT"] = str(ports[2])
    torch.distributed.init_process_group("gloo")
    try:
        got = {"stream": (code, err.getvalue())}
        tokens = _calib()[:5]  # 5 samples: rank 0 sums 3, rank 1 sums 2
        sal, _ = fisher_salience(tiny_llama(0), tokens, cache_dir=None, progress=False, dist=current())
        got["fisher"] = sal
        for method, opts in API_RUNS.items():
            model = tiny_llama(0)
            report = quantize_(model, method, _calib(), batch_size=2, progress=False, **opts)
            got[method] = {"codes": quantized_codes(model), "dist": report.calibration["distributed"],
                           "transform": [r.get("transform") for r in report.layers]}  # fmt: skip
        torch.save(got, os.path.join(tmp, f"api{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _same_fraction(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and len(a) == 14  # 2 layers x 7 linears, really compared
    same = sum(int((a[n] == b[n]).sum()) for n in a)
    total = sum(a[n].numel() for n in a)
    assert total > 10_000
    return same / total


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    save_hf_dir(tmp / "model", tiny_llama(0))
    (tmp / "calib.txt").write_text(words(4000))
    torch.multiprocessing.spawn(_worker, args=(2, free_ports(3), str(tmp)), nprocs=2, join=True)
    return tmp


def test_two_processes_give_the_codes_of_one_and_only_rank0_writes(runs, capsys):
    single = runs / "single"
    args = ["--model", str(runs / "model"), "--calib", str(runs / "calib.txt"), "--out", str(single)]
    assert main([*CLI_FLAGS, *args]) == 0
    capsys.readouterr()
    one, _ = load_quantized(single)
    dp, _ = load_quantized(runs / "dp")
    assert _same_fraction(quantized_codes(dp), quantized_codes(one)) >= 0.999
    report = json.loads((runs / "dp.json").read_text())
    assert report["calibration"]["distributed"]["samples_per_rank"] == [4, 3]
    assert len(report["calibration"]["distributed"]["peak_rss_mb_per_rank"]) == 2
    written = sorted(p.name for p in runs.iterdir())  # no "st" nor its partial folder: refused up front
    assert written == ["api0.pt", "api1.pt", "calib.txt", "dp", "dp.json", "model", "single"]
    ids = torch.randint(4, 128, (1, 8 * 32), generator=torch.Generator().manual_seed(1))
    ppl = [perplexity(m, ids, 32, progress=False)["ppl"] for m in (dp, one)]
    assert abs(ppl[0] / ppl[1] - 1) < 1e-3, ppl


def test_a_streamed_run_is_refused_on_every_rank_in_one_line(runs):
    for r in (0, 1):
        code, err = torch.load(runs / f"api{r}.pt")["stream"]
        assert code == 2 and err.count("\n") == 1, err
        assert "would stream (--stream on)" in err and "2 processes" in err and "--stream off" in err


def test_fisher_sums_over_ranks_equal_one_process_up_to_rounding(runs):
    got = [torch.load(runs / f"api{r}.pt")["fisher"] for r in (0, 1)]
    one, _ = fisher_salience(tiny_llama(0), _calib()[:5], cache_dir=None, progress=False)
    assert set(got[0]) == set(one) and len(one) == 14
    for n in one:
        assert torch.equal(got[0][n], got[1][n]), n  # the same bits on every rank (rank-order sum)
        assert one[n].abs().sum() > 0
        torch.testing.assert_close(got[0][n], one[n], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("method", sorted(API_RUNS))
def test_smoothing_methods_match_one_process_and_every_rank_agrees(runs, method):
    r0, r1 = (torch.load(runs / f"api{r}.pt")[method] for r in (0, 1))
    for n in r0["codes"]:  # every rank packs the same gathered results: bit for bit
        assert torch.equal(r0["codes"][n], r1["codes"][n]), n
    model = tiny_llama(0)
    report = quantize_(model, method, _calib(), batch_size=2, progress=False, **API_RUNS[method])
    assert "distributed" not in report.calibration
    assert _same_fraction(r0["codes"], quantized_codes(model)) >= 0.999
    choice = {"awq": "ratio", "smoothquant": "alpha"}[method]  # the searches chose the same factors
    picked = [t.get(choice) for t in r0["transform"]]
    assert any(p is not None for p in picked)
    assert picked == [r["transform"].get(choice) for r in report.layers]


def test_split_deals_batches_round_robin_and_refuses_too_many_ranks():
    calib = torch.arange(7 * 3).reshape(7, 3)
    d1 = Dist(rank=1, world=2)
    share = d1.split(calib, 2)  # batches [0,1] [2,3] [4,5] [6]: rank 1 takes the 2nd and 4th
    assert share[:, 0].tolist() == [6, 9, 18] and d1.batches == 4
    assert Dist(rank=0, world=2).split(calib, 2)[:, 0].tolist() == [0, 3, 12, 15]
    with pytest.raises(OptionError, match="5 processes but only 4 calibration batches"):
        Dist(rank=0, world=5).split(calib, 2)


def test_cat_rows_undoes_select_rows():
    g = torch.Generator().manual_seed(0)
    res = QuantResult(torch.randint(0, 15, (10, 8), generator=g), torch.rand(10, 2), torch.rand(10, 2),
                      torch.arange(8) // 4, step_errors=torch.rand(10), pivots=torch.rand(8))  # fmt: skip
    back = QuantResult.cat_rows([res.select_rows(0, 3), res.select_rows(3, 10)])
    for f in ("codes", "scales", "zeros", "g_idx", "step_errors", "pivots"):
        assert torch.equal(getattr(back, f), getattr(res, f)), f


@pytest.mark.parametrize("n,world", [(576, 2), (1536, 2), (1536, 3), (100, 2)])
def test_hessian_block_rows_dealt_over_ranks_add_up_bit_for_bit(n, world):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(64, n, generator=g) * torch.rand(n, generator=g) for _ in range(3)]
    whole = HessianAccumulator(n)
    parts = [HessianAccumulator(n) for _ in range(world)]
    mine = [Dist(rank=r, world=world).hessian_blocks(parts[r]) for r in range(world)]
    assert sorted(k for m in mine for k in m) == list(range(len(whole.block_starts)))  # each block once
    for x in xs:
        whole.add(x)
        for acc, m in zip(parts, mine, strict=True):
            acc.add(x, m)
    for r, m in enumerate(mine):  # what gather_hessian does: the owner's block rows into rank 0's
        for k in m:
            parts[0].block_row(k).copy_(parts[r].block_row(k))
    assert torch.equal(parts[0].H, whole.H)


def test_one_process_capture_is_unchanged_by_the_dist_argument():
    model = tiny_llama(0)
    layer = model.model.layers[0]
    from bitmosaic.models.arch import get_arch

    arch = get_arch(model)
    hs = [torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    pos = model.model.rotary_emb(hs[0], torch.arange(8)[None])
    kw = [{"position_embeddings": pos, "attention_mask": None}] * 3
    caps = [
        capture_groups(layer, arch, hs, kw, max_tokens=10, generator=torch.Generator().manual_seed(1), dist=d)
        for d in (None, Dist())
    ]
    for c0, c1 in zip(*caps, strict=True):
        assert torch.equal(c0.sample, c1.sample) and torch.equal(c0.hessian, c1.hessian)
