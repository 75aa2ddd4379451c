"""Mixture-of-experts models: export checks recorded where CI cannot run them (llama.cpp)."""
