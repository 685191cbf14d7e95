"""mobc: compile Hugging Face causal LMs into verified static-shape NPU step graphs and decode them.

The package by layer, top to bottom (tests/test_architecture.py checks the rules in brackets;
no module anywhere imports another in a cycle or takes a private name from it):

    cli/        one module per command group, all registered in cli/main.py
    features    lora/ diffusion/ hub/ bench/ train/ quantize/ qnn/: each feature in one place
    compile/    recipe -> source -> capture -> export -> pass_runner -> emit -> verify (pipeline.py)
    runtime/    sessions, KV cache, StepModel, policies  [imports artifact/, cost/, qnn/ only;
                never torch or transformers]
    cost/       the phone cost model and per-call prices  [imports artifact/ only]
    ir/         GraphSet and the onnx_ir helpers of passes and stages  [imports artifact/ only]
    artifact/   the compiler-runtime contract: Manifest, StepLayout, stage chains  [numpy/json only]
    errors.py   the user-facing error hierarchy

Graph passes are the top-level `passes` package (one pass per file; base classes in passes/base.py)
[imports ir/ and artifact/ only].
"""

__version__ = "0.1.0"
