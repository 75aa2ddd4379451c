"""SpinQuant's learned rotations (``--rotate spinquant``): Cayley SGD keeps the rotation orthogonal and
descends; the learned R1/R2 leave the float model unchanged and lower the quantized-activation loss
below the Hadamard rotation they start from; the option parses, labels and refuses in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from bitmosaic.algorithms.rotation import cayley_step, random_orthogonal
from bitmosaic.errors import OptionError
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.models.arch import get_arch
from bitmosaic.pipeline.rotate import parse_rotation, rotate_model
from bitmosaic.pipeline.spin import _ste_hook, dynamic_form
from tests.pipeline.test_rotate import VOCAB, tiny


def test_cayley_step_orthogonal_and_descends():
    X = random_orthogonal(16, 0)
    M = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    Xg = X.clone().requires_grad_(True)
    ((Xg - M) ** 2).sum().backward()
    for lr in (1e-3, 0.05, 10.0):  # orthogonal for any rate
        Y = cayley_step(X, Xg.grad, lr)
        assert (Y @ Y.T - torch.eye(16, dtype=torch.float64)).abs().max() < 1e-12
    Y = cayley_step(X, Xg.grad, 1e-2)
    assert ((Y - M) ** 2).sum() < ((X - M) ** 2).sum()
    assert torch.equal(cayley_step(X, torch.zeros_like(X), 1.0), X)  # no gradient: no move


def _quantized_loss(model, ids, act):
    arch = get_arch(model)
    hooks = [
        layer.get_submodule(n).register_forward_pre_hook(_ste_hook(act))
        for layer in arch.layers(model)
        for g in arch.sequential
        for n in g
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).item()


def test_learned_rotation_keeps_float_and_beats_its_hadamard_start():
    model = tiny("llama")
    with torch.no_grad():  # a residual outlier channel, as real models have
        model.model.embed_tokens.weight[:, 7] *= 20
    calib = torch.randint(4, VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(4, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    act = ActQuantSpec("int", 2)  # coarse enough that the rotation matters on a tiny model
    with torch.no_grad():
        ref = model(ids).logits
    hadamard = copy.deepcopy(model)
    rotate_model(hadamard, get_arch(hadamard), "hadamard")
    info = rotate_model(model, get_arch(model), "spinquant:steps=30,lr=1.5", calib=calib, act=act)
    with torch.no_grad():
        out = model(ids).logits
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()  # the float function is unchanged
    assert info["kind"] == "spinquant:steps=30,lr=1.5" and info["learned"]["steps"] == 30
    assert len(info["online"]) == 4
    learned, start = _quantized_loss(model, calib, act), _quantized_loss(hadamard, calib, act)
    assert learned < start - 0.05, (learned, start)
    # the learned R1 differs from the Hadamard start (the weights differ beyond rounding)
    assert (
        model.model.layers[0].mlp.up_proj.weight - hadamard.model.layers[0].mlp.up_proj.weight
    ).abs().max() > 1e-3


def test_spinquant_needs_activation_quantization():
    model = tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OptionError, match=r"this run has none .*: use --rotate hadamard") as e:
        rotate_model(model, get_arch(model), "spinquant", calib=torch.zeros(1, 8, dtype=torch.long))
    assert "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


@pytest.mark.parametrize(
    "text,label",
    [("none", "none"), (None, "none"), ("hadamard", "hadamard"), ("spinquant", "spinquant"),
     ("spinquant:steps=100,lr=1.5", "spinquant"), ("spinquant:steps=20", "spinquant:steps=20,lr=1.5"),
     ("spinquant:batch=1", "spinquant"), ("spinquant:batch=8", "spinquant:steps=100,lr=1.5,batch=8")],
)  # fmt: skip
def test_parse_rotation(text, label):
    assert parse_rotation(text).label == label


@pytest.mark.parametrize(
    "text", ["quarot", "hadamard:steps=3", "spinquant:steps=0", "spinquant:lr=-1", "spinquant:epochs=3",
             "spinquant:steps=x", "spinquant:batch=0", "spinquant:batch=2.5"],
)  # fmt: skip
def test_bad_rotation_one_line(text):
    with pytest.raises(OptionError, match=r"--rotate") as e:
        parse_rotation(text)
    assert "\n" not in str(e.value)


def test_a_batch_step_descends_the_mean_loss_of_its_samples():
    """``batch=B``: a step's loss is the mean cross-entropy of B calibration samples (here samples 0
    and 1 of 3), and its Cayley step is the one that loss's gradient gives, computed here by hand."""
    from torch.func import functional_call

    from bitmosaic.pipeline.rotate import RotationSpec, prepare_rotation, rotated_state
    from bitmosaic.pipeline.spin import learn_rotation

    model = tiny("llama")
    arch = get_arch(model)
    calib = torch.randint(4, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    act = ActQuantSpec("int", 4)
    d, heads = model.config.hidden_size, model.config.num_attention_heads
    prepare_rotation(model, arch, "hadamard", 0)
    Q1 = random_orthogonal(d, 0)
    R2 = [random_orthogonal(d // heads, 1)] * len(arch.layers(model))
    spec = RotationSpec("spinquant", steps=1, lr=1.5, batch=2)
    Qb, Rb, info = learn_rotation(model, arch, (Q1, R2), calib, act, spec, rotated_state)
    assert info["batch"] == 2 and all(r.device == Q1.device for r in [Qb, *Rb])
    assert info["cycle"] == 3 and info["losses"] == [info["loss_first"]]  # 3 samples, 2 a step: 3 steps
    Q = Q1.float().requires_grad_(True)
    R = [r.float().requires_grad_(True) for r in R2]
    hooks = [layer.get_submodule(n).register_forward_pre_hook(_ste_hook(act))
             for layer in arch.layers(model) for g in arch.sequential for n in g]  # fmt: skip
    base = {n: p.detach() for n, p in model.named_parameters()}
    logits = functional_call(model, rotated_state(model, arch, Q, R, base), (calib[:2],)).logits
    for h in hooks:
        h.remove()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), calib[:2, 1:].reshape(-1))
    assert info["loss_first"] == pytest.approx(float(loss.detach()), rel=1e-5)
    gQ = torch.autograd.grad(loss, Q)[0]
    assert torch.allclose(Qb, cayley_step(Q.detach(), gQ, 1.5).double(), atol=1e-5)


def test_static_quantizer_learned_as_its_dynamic_form():
    assert dynamic_form(ActQuantSpec("int", 8, granularity="tensor", static=True)).granularity == "token"
    g = ActQuantSpec("int", 4, granularity="group", group_size=64, static=True)
    assert dynamic_form(g) == ActQuantSpec("int", 4, granularity="group", group_size=64)
    tok = ActQuantSpec("int", 4)
    assert dynamic_form(tok) is tok


def test_cli_spinquant_saves_inspects_and_reproduces(tmp_path, capsys):
    """End to end: a W4A4 run with a learned rotation saves, says so in ``inspect`` and in the run
    report, and ``reproduce`` relearns the same rotation bit for bit; a bad value is one line, exit 2."""
    import json

    from bitmosaic.cli import main
    from tests.helpers import cli_quantize_args

    out = tmp_path / "q"
    base = cli_quantize_args(tmp_path)
    rot = "spinquant:steps=3,lr=1.5"
    assert main([*base, "--rotate", rot, "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    learned = json.loads((tmp_path / "r.json").read_text())["calibration"]["rotation"]["learned"]
    assert learned["steps"] == 3 and learned["loss_first"] > 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "rotation         spinquant:steps=3,lr=1.5 (seed 0)" in capsys.readouterr().out
    assert main(["reproduce", str(out)]) == 0
    assert "match bit for bit" in capsys.readouterr().out
    assert main([*base, "--rotate", "spinquant:step=3", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "steps=N" in err and "\n" not in err
    assert not (tmp_path / "bad").exists()
