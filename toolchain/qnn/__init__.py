"""QNN HTP context binaries through onnxruntime-qnn: build, run and compare (context.py), and
why a graph was rejected (diagnose.py)."""
