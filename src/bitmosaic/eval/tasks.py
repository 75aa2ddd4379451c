"""Zero-shot tasks through lm-eval-harness, on a model already in memory (quantized or not).

:func:`run_tasks` wraps the model in lm-eval's ``HFLM`` (so our quantized modules, with their CPU
kernels, run every request) and calls ``lm_eval.simple_evaluate``.  The standard set is
:data:`ZERO_SHOT`.

Where task data comes from:

* online: the Hugging Face hub, through lm-eval's own task definitions;
* offline, standard tasks: the ``datasets`` cache of an earlier online run (set
  ``HF_DATASETS_OFFLINE=1``; ``HF_DATASETS_CACHE`` points at it);
* offline, any task: ``tasks_dir``, a folder of lm-eval task YAML files (lm-eval's own format,
  loaded with ``TaskManager(include_path=...)``) whose ``dataset_path`` names local data, e.g.
  ``dataset_path: json`` with ``dataset_kwargs: {data_files: {validation: /data/piqa/valid.jsonl}}``.
  A task named there overrides lm-eval's definition of the same name.

When a task's data can be had from none of these, one :class:`~bitmosaic.errors.BitmosaicError`
says which task and how to provide it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BitmosaicError

__all__ = ["ZERO_SHOT", "run_tasks"]

ZERO_SHOT = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "winogrande", "boolq", "lambada_openai")

_OFFLINE_HELP = (
    "run once online to fill the datasets cache, or pass a folder of task YAMLs with local data "
    "(--tasks-dir; see bitmosaic.eval.tasks)"
)


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise BitmosaicError(
            "zero-shot tasks need lm-eval-harness: pip install 'bitmosaic[eval]' (or lm_eval)"
        ) from None
    return lm_eval, HFLM, TaskManager


def _metrics(task_result: dict) -> dict:
    """``{"acc,none": 0.5, "acc_stderr,none": ...}`` -> ``{"acc": 0.5, "acc_stderr": ...}``."""
    out = {}
    for key, value in task_result.items():
        if key == "alias" or not isinstance(value, int | float):
            continue
        name, _, filt = key.partition(",")
        out[name if filt in ("", "none") else f"{name},{filt}"] = float(value)
    return out


def run_tasks(
    model,
    tokenizer,
    tasks: list[str] | tuple[str, ...] = ZERO_SHOT,
    *,
    limit: int | float | None = None,
    batch_size: int = 1,
    tasks_dir: str | Path | None = None,
    device: str | None = None,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Zero-shot scores ``{task: {metric: value}}`` (``acc``, ``acc_norm``, ``perplexity``, with their
    ``*_stderr``) of ``model`` (a transformers causal LM, possibly quantized by bitmosaic) on ``tasks``.

    ``limit``: at most that many documents per task (a fraction when below 1), as lm-eval's ``--limit``;
    ``seed`` fixes lm-eval's random, numpy and torch seeds.
    """
    if not tasks:
        raise BitmosaicError("no task given; e.g. arc_easy,piqa (the standard set: bitmosaic.eval.ZERO_SHOT)")
    if tokenizer is None:
        raise BitmosaicError("zero-shot tasks need the model's tokenizer; this model folder has none saved")
    if tasks_dir is not None and not Path(tasks_dir).is_dir():
        raise BitmosaicError(f"--tasks-dir {tasks_dir} is not a folder of lm-eval task YAML files")
    lm_eval, HFLM, TaskManager = _lm_eval()
    manager = None
    if tasks_dir:  # lm-eval indexes its ~15k task files in tens of seconds: skip that when not needed
        manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
        if any(t not in manager.all_tasks for t in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=str(tasks_dir)) if tasks_dir else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise BitmosaicError(
            f"unknown task(s) {unknown}: not lm-eval tasks"
            + ("" if tasks_dir else " (local tasks need --tasks-dir)")
        )
    if device is None:
        device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    try:
        res = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            limit=limit,
            task_manager=manager,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            bootstrap_iters=0,
        )
    except (ConnectionError, FileNotFoundError) as e:
        raise BitmosaicError(f"task data for {list(tasks)} is not available ({e}); {_OFFLINE_HELP}") from None
    except Exception as e:  # datasets/hub raise their own offline errors: name them, with the fix
        kind = type(e).__name__
        if "Offline" in kind or "Connection" in kind or "offline" in str(e).lower():
            raise BitmosaicError(f"task data for {list(tasks)} is not available offline ({kind}); "
                                 f"{_OFFLINE_HELP}") from None
        raise
    return {task: _metrics(r) for task, r in res["results"].items()}
