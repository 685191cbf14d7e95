"""The quantize stage: calibration on real text, QDQ graphs, the GGUF source grid, graph QAT,
AIMET encodings, perplexity, sensitivity and the quantized HTP check."""
