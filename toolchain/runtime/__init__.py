"""The runtime: onnxruntime sessions over an artifact, one KV cache manager, StepModel, trees
and the decoding policies (policies/). It imports the artifact contract and the cost model,
never the compiler, torch or transformers, so `mobc run` starts in well under a second."""
