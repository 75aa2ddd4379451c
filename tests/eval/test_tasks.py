"""The lm-eval bridge on a tiny task built here (local JSON lines + an lm-eval task YAML)."""

import json

import pytest

from bitmosaic.errors import BitmosaicError
from tests.helpers import tiny_llama, word_tokenizer

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; pip install -e .[dev]")

from bitmosaic.eval.tasks import run_tasks  # noqa: E402


def _task_dir(tmp_path, n=6):
    docs = [
        {"query": f"w{i} w{i + 1}", "choices": [f"w{i + 2}", f"w{i + 40}"], "gold": i % 2} for i in range(n)
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{query}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tmp_path, docs


def _expected_acc(model, tok, docs):
    """Independent scoring: sum of the choice's token log-probs after the query, argmax vs gold."""
    import torch

    right = 0
    for d in docs:
        ctx = tok(d["query"])["input_ids"]
        scores = []
        for c in d["choices"]:
            cont = tok(" " + c)["input_ids"]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].double(), -1)
            scores.append(sum(float(lp[len(ctx) - 1 + k, t]) for k, t in enumerate(cont)))
        right += int(max(range(len(scores)), key=scores.__getitem__) == d["gold"])
    return right / len(docs)


def test_tiny_local_task_scores_like_an_independent_loglikelihood(tmp_path):
    d, docs = _task_dir(tmp_path)
    model, tok = tiny_llama(), word_tokenizer()
    res = run_tasks(model, tok, ["tiny_choice"], tasks_dir=d, device="cpu")
    assert set(res) == {"tiny_choice"}
    assert res["tiny_choice"]["acc"] == pytest.approx(_expected_acc(model, tok, docs))


def test_quantized_model_runs_through_the_bridge(tmp_path):
    import torch

    from bitmosaic import quantize_

    d, docs = _task_dir(tmp_path, n=4)
    model, tok = tiny_llama(), word_tokenizer()
    calib = torch.randint(4, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_(model, "rtn", calib, bits=4, group_size=32, progress=False)
    res = run_tasks(model, tok, ["tiny_choice"], tasks_dir=d, device="cpu", limit=4)
    assert res["tiny_choice"]["acc"] == pytest.approx(_expected_acc(model, tok, docs))


def test_bad_arguments_are_one_line_errors(tmp_path):
    model, tok = tiny_llama(), word_tokenizer()
    with pytest.raises(BitmosaicError, match="no task"):
        run_tasks(model, tok, [])
    with pytest.raises(BitmosaicError, match="not a folder"):
        run_tasks(model, tok, ["piqa"], tasks_dir=tmp_path / "missing")
    with pytest.raises(BitmosaicError, match="tokenizer"):
        run_tasks(model, None, ["piqa"])
