"""``bitmosaic generate DIR --prompt TEXT``: text from a saved bitmosaic folder in the terminal (issue 74).

The folder loads as ``bitmosaic.load(DIR)`` does, so decode runs the compiled step by default
(:func:`~bitmosaic.modules.decode.default_compiled_decode`; ``--no-compile`` or
``$BITMOSAIC_NO_COMPILE=1``: eager).  The new text streams to stdout as it is generated; the prefill and
decode rates go to stderr, one line each.  ``--runtime-act`` gives the weight-only layers run-time
integer activations, as ``bitmosaic eval --runtime-act`` does (``int16``: within the verdict protocol's
noise of weight-only, docs/cpu-inference.md).  The decode rate leaves out the first decode step, which is
where the step compiles (its seconds are printed beside it).  The static KV cache holds the prompt plus
``--max-new-tokens`` rounded up to a multiple of ``CACHE_BUCKET`` tokens (at most the model's positions):
the compiled step depends on that length, so a later run with another prompt of a similar size finds
it in the cache on disk instead of compiling again.  Only bitmosaic folders: a GGUF file or a float model
is refused in one line (llama.cpp runs GGUF files; ``bitmosaic quantize --out`` makes a folder).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .eval_options import add_runtime_act_argument

CACHE_BUCKET = 256  # the static KV cache's length is rounded up to a multiple of this
HELP = "generate text from a saved bitmosaic model folder (streamed to stdout; tok/s on stderr)"


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help=HELP, description=HELP)
    g.add_argument("dir", help="a folder saved by `bitmosaic quantize --out` (with its tokenizer)")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)"
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--temperature", type=float, default=0.0,
        help="0: greedy (the same tokens every run); above 0: sampling at this temperature "
        "(default: %(default)s)",
    )  # fmt: skip
    add_runtime_act_argument(g)
    g.add_argument(
        "--no-compile", action="store_true",
        help="decode eagerly instead of through the compiled step (no one-time compile; slower per token; "
        "= $BITMOSAIC_NO_COMPILE=1)",
    )  # fmt: skip


def _check(args) -> Path:
    """The folder, after the flags are checked (one-line errors naming the fix)."""
    from ..errors import OptionError

    if args.max_new_tokens < 1:
        raise OptionError(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise OptionError(f"--threads must be at least 1, not {args.threads}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise OptionError(f"--temperature must be a finite number >= 0 (0: greedy), not {args.temperature}")
    if not args.prompt:
        raise OptionError("--prompt is empty: give the text to continue")
    path = Path(args.dir)
    if not path.is_dir():
        what = "a GGUF file (run it with llama.cpp)" if path.suffix.lower() == ".gguf" else "not a folder"
        if not path.exists():
            what = "does not exist"
        raise OptionError(
            f"{path} {what}: bitmosaic generate takes a folder saved by `bitmosaic quantize --out`"
        )
    from ..errors import CorruptModelError
    from ..io.saved.load import read_quant_config

    try:
        read_quant_config(path)
    except CorruptModelError as e:
        if "not a bitmosaic model" not in str(e):
            raise
        raise OptionError(
            f"{path} is not a bitmosaic folder (a float model?): quantize it first "
            f"(bitmosaic quantize --model {path} --out DIR), then run bitmosaic generate DIR"
        ) from None
    return path


class _Rates:
    """A ``TextStreamer`` that also notes when each ``put`` came: the prompt, then each new token."""

    def __init__(self, tokenizer) -> None:
        from transformers import TextStreamer

        outer = self

        class Streamer(TextStreamer):
            def put(self, value):
                outer.times.append(time.perf_counter())
                super().put(value)

        self.times: list[float] = []
        self.streamer = Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def report(self, n_prompt: int, compiled: bool) -> list[str]:
        """The stderr lines: prefill (prompt put -> first token) and decode rates."""
        t = self.times
        lines = []
        if len(t) >= 2:
            pre = t[1] - t[0]
            lines.append(f"prefill: {n_prompt} tokens in {pre:.3f} s ({n_prompt / pre:.1f} tok/s)")
        skip = 1 if compiled else 0  # the first decode step is where the step compiles
        steps = t[1 + skip :]
        if len(steps) >= 2:
            n, dt = len(steps) - 1, steps[-1] - steps[0]
            note = f" (after the first decode step, {t[2] - t[1]:.2f} s, which compiles)" if skip else ""
            lines.append(f"decode: {n} tokens in {dt:.3f} s ({n / dt:.1f} tok/s){note}")
        else:
            lines.append("decode: too few tokens to measure a rate (raise --max-new-tokens)")
        return lines


def cmd_generate(args) -> int:
    import torch

    from ..errors import CorruptModelError
    from ..io.saved.hf_integration import load

    path = _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load(path, compile=not args.no_compile)  # one line for a folder that is not ours
    if args.runtime_act is not None:  # the compiled step compiles again for it (modules/changes.py)
        from ..modules.intact import set_runtime_activations

        n = set_runtime_activations(model, args.runtime_act)
        if args.runtime_act != "none":
            print(
                f"runtime activations {args.runtime_act}: {n} weight-only layers (not saved)", file=sys.stderr
            )
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CorruptModelError(
            f"{path} has no usable tokenizer ({' '.join(str(e).split())[:120]}); save the model with its "
            "tokenizer (bitmosaic quantize --out does)"
        ) from None
    ids = tok(args.prompt, return_tensors="pt").input_ids
    rates = _Rates(tok)
    extra = {"temperature": args.temperature} if args.temperature > 0 else {}
    compiled = hasattr(model, "_compiled_call")
    if compiled:  # one static cache length per bucket: other prompts reuse the step cached on disk
        need = ids.shape[1] + args.max_new_tokens
        bucket = -(-need // CACHE_BUCKET) * CACHE_BUCKET
        positions = getattr(model.config, "max_position_embeddings", need)
        extra["max_cache_len"] = max(need, min(bucket, positions))
    with torch.inference_mode():
        model.generate(
            ids, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, streamer=rates.streamer,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, **extra,
        )  # fmt: skip
    sys.stdout.flush()
    compiled = compiled and not getattr(model._compiled_call, "eager", False)
    for line in rates.report(ids.shape[1], compiled):
        print(line, file=sys.stderr)
    return 0
