"""How a CPU session must run an artifact's QDQ graphs, for every reader of them (the runtime, the
compile's checks, the HTP comparison).

A QDQ graph is the NPU's integer arithmetic written as float ops on dequantized values; onnxruntime
fuses it into its own integer kernels, which are not that arithmetic on this CPU: int4/int8 weights
-> MatMulNBits with int8 activations (a W4A16 product 223 16-bit steps off), uint8 x int8 -> AVX2
kernels that saturate (138 8-bit steps off; measured against the unfused graph, which matches numpy
and, within a step, the QNN HTP). Unfused, the CPU runs the QDQ arithmetic exactly. Graphs without
Q/DQ nodes (float, mobc's CPU form) are unaffected.
"""

from __future__ import annotations

# a session config entry: onnxruntime.SessionOptions.add_session_config_entry(*QDQ_EXACT)
QDQ_EXACT = ("session.disable_quant_qdq", "1")
