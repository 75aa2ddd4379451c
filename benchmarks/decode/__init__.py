"""End-to-end greedy decoding on the CPU: tokens/s, memory, the compiled step's profile and overhead."""
