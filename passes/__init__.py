"""Graph passes over onnx_ir, one pass per file; importing this package registers them all."""

from passes.registry import PASSES, build, register

__all__ = ["PASSES", "build", "register"]

# importing a pass module registers it
from passes import fold_constants, split_layers, split_lm_head  # noqa: E402,F401
from passes import scale_rmsnorm  # noqa: E402,F401
