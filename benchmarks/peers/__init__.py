"""bitmosaic beside other tools: llama.cpp (GGUF, decode), GPTQModel, llm-compressor (speed)."""
