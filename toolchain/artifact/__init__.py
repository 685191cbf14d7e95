"""The compiler-runtime contract: what an artifact folder holds and how its graphs chain.

manifest.py (the typed Manifest: one writer, one reader), layout.py (the step graph's inputs and
outputs, the mask constant), chain.py (stages of a family run in order, joined by tensor name).
numpy and json only: the compiler and the runtime both import it, the runtime nothing else of
the compiler.
"""
