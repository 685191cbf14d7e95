"""The `mobc` command line: main.py registers every group; one module per group; common.py
holds the console, shared options and table helpers."""
