"""Graph passes over onnx_ir, one pass per file; importing this package registers them all."""

from passes.registry import PASSES, build, register

__all__ = ["PASSES", "build", "register"]
