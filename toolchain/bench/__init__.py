"""`mobc bench` tables: each policy family against its baseline in one process (CPU time and
predicted phone time), llama.cpp rows, prompt sets and plots."""
