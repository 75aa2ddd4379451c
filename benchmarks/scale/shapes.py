"""The model shapes the scale benchmarks use (one table: ``real_shapes.py`` and ``gpu_scale.py``).

Each entry holds the ``LlamaConfig`` fields that define the shape, taken from the published
``config.json`` of the model it is named after (meta-llama/Meta-Llama-3-8B, -70B, Llama-3.1-405B);
the ``-layer`` shapes keep one decoder layer of that model, the ``-layer`` of 8B for profiling one
layer's memory without writing the whole checkpoint.  Weights are random: timings and memory do not
depend on their values.
"""

from __future__ import annotations

_LLAMA3 = dict(
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
_8B = dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_attention_heads=32)
_70B = dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_attention_heads=64)
_405B = dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_attention_heads=128)

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(_8B, num_hidden_layers=32),
    "llama3-8b-layer": dict(_8B, num_hidden_layers=1),
    "llama3-70b-layer": dict(_70B, num_hidden_layers=1),
    # for the arithmetic of docs/scaling.md (quantizing it needs ~40 GB: more than this machine has)
    "llama3-405b-layer": dict(_405B, num_hidden_layers=1),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    ),
}
