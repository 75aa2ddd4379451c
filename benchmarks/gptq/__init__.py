"""GPTQ on SmolLM2-135M: orders, static groups, the foundation rows, the llm-compressor anchor protocol."""
