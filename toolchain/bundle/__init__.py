"""Deployable bundles: artifacts in the formats phone runtimes load (onnxruntime-genai)."""
