"""One intra-op thread pool per mobc command process (toolchain/runtime/sessions.py): shared by every
session opened after `share_thread_pool`, never imposed on a process that opened sessions of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

GRAPH = """
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
MODEL = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
def run(so):
    return ort.InferenceSession(MODEL, so, providers=["CPUExecutionProvider"]).run(
        None, {"x": np.array([-1.0, 0.0, 2.0], np.float32)})[0].tolist()
"""


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", GRAPH + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_fresh_process_shares_one_pool_from_its_first_session():
    out = _python("""
        from toolchain.runtime.sessions import session_options, share_thread_pool
        assert share_thread_pool(2)
        so = session_options(1)  # a per-call thread count no longer gives the session a pool of its own
        assert not so.use_per_session_threads
        assert share_thread_pool(1)  # already shared: the first size stays
        print(run(so), run(session_options(2)))
    """)
    assert out == "[0.0, 0.0, 2.0] [0.0, 0.0, 2.0]"


def test_a_process_that_opened_sessions_keeps_their_pools():
    out = _python("""
        from toolchain.runtime.sessions import session_options, share_thread_pool
        first = run(session_options(1))
        assert not share_thread_pool(2)
        so = session_options(2)
        assert so.use_per_session_threads and so.intra_op_num_threads == 2
        print(first, run(so), run(ort.SessionOptions()))  # a plain session still opens: nothing was imposed
    """)
    assert out == "[0.0, 0.0, 2.0] [0.0, 0.0, 2.0] [0.0, 0.0, 2.0]"
