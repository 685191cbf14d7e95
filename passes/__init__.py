"""Graph passes over onnx_ir, one pass per file; importing this package registers them all."""

from passes.registry import PASSES, argmax_exact_outputs, build, check_order, register

__all__ = ["PASSES", "argmax_exact_outputs", "build", "check_order", "register"]

# importing a pass module registers it
from passes import (  # noqa: E402,F401
    attend_past_in_place,
    cache_attention,
    certified_lm_head,
    check_htp,
    expose_features,
    fold_constants,
    forecast_inputs,
    fuse_attention_prologue,
    fuse_projections,
    fuse_rmsnorm,
    fuse_rotary,
    fuse_silu_mul,
    fuse_skip_rmsnorm,
    linear_to_conv,
    lora_inputs,
    matmul_nbits,
    mha_to_sha,
    rescale_residual,
    scale_rmsnorm,
    simplify_layout,
    split_layers,
    split_lm_head,
)
