"""onnxruntime sessions over an artifact folder: one session per graph, families run as chains.

Two ways to run a family: `run_family(feeds)` (dicts in, fresh arrays out; verification) and
`bind(family, inputs)` -> BoundFamily, which binds preallocated input and output arrays once
with onnxruntime IO binding, so a decode step allocates nothing: the caller writes the next
inputs into the same arrays and reads the outputs from the same arrays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from toolchain import kernels
from toolchain.artifact.chain import KEPT_OUTPUTS, run_chain
from toolchain.artifact.integrity import fix_hint
from toolchain.artifact.layout import StepLayout
from toolchain.artifact.manifest import ROPE, GraphRecord, Manifest
from toolchain.artifact.qdq_arithmetic import QDQ_EXACT
from toolchain.errors import ArtifactError
from toolchain.runtime.cache import StackedRows
from toolchain.runtime.shared_weights import SharedWeights

# Weight bytes a memory-bounded user of an artifact (the compile's checks, calibration) keeps in open
# sessions; parts are cut to about this size, so a 8B model is checked one part at a time.
# passes whose graphs are the CPU form (onnxruntime contrib ops, fused by mobc itself)
CPU_FORM_PASSES = ("matmul_nbits", "certified_lm_head", "fuse_rmsnorm", "fuse_rotary")
PART_BUDGET_BYTES = float(os.environ.get("MOBC_PART_BUDGET_BYTES", 1.0e9))


# One intra-op thread pool for all of a process's sessions, when the process is a mobc command that
# runs models (`share_thread_pool`). Each session's own pool keeps a thread spinning after its call,
# so a target's verify sessions and a draft's sessions taking turns on 2 cores fought over them
# (`mobc bench decode`, int16 CPU form + int8 head, 2 threads, 16 prompts: chain+lookup 0.32x ar and
# lever+cpu+lookup 0.48x with a pool per session; 0.70x and 0.85x with one shared pool, ar unchanged
# at 114-118 tok/s; spinning off everywhere instead cost ar 18%). onnxruntime decides it once per
# process and then refuses sessions with pools of their own, so it is only done before the process
# opened any session through here (a library user's or a test process's sessions keep their pools).
_threads = {"opened": False, "shared": False}


def share_thread_pool(threads: int | None) -> bool:
    """From here on every session of this process runs on one intra-op pool of `threads` (None: one
    thread per core), unless sessions were opened already (then nothing changes). True when shared."""
    if _threads["shared"]:
        return True
    if _threads["opened"]:
        return False
    from onnxruntime.capi import _pybind_state

    set_sizes = getattr(_pybind_state, "set_global_thread_pool_sizes", None)  # a build without it: own pools
    if set_sizes is None:
        return False
    set_sizes(threads or 0, 1)
    _threads["shared"] = True
    return True


def thread_options(so: ort.SessionOptions, threads: int | None) -> ort.SessionOptions:
    """`so` on the process's shared pool, or on a pool of its own of `threads`."""
    _threads["opened"] = True
    if _threads["shared"]:
        so.use_per_session_threads = False
    elif threads:
        so.intra_op_num_threads = threads
    return so


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry(*QDQ_EXACT)
    kernels.register(so)  # mobc's own CPU ops (toolchain/kernels/), when this machine can build them
    return thread_options(so, threads)


def reopenable_session_options(threads: int | None = None, prepack: bool = False) -> ort.SessionOptions:
    """For sessions opened and closed over and over under a memory budget: cheap to open
    (measured on a 1 GB part of a 1.2B Llama: 0.4 s at BASIC vs 4.6-7.8 s at ALL) and without
    prepacked kernels (a second copy of every weight) unless `prepack`: graphs with MatMulNBits
    need it (see prepacking_changes_numerics)."""
    so = session_options(threads)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def prepacking_changes_numerics(op_types: set[str]) -> bool:
    """MatMulNBits runs its accuracy_level (int8 activations at level 4) only with prepacked weights;
    unpacked it falls back to float32 compute (measured: SmolLM2 at level 4, max |logit diff| 0.49
    prepacked vs 2.5e-05 unpacked). A check must run the kernels the runtime runs, so such graphs
    are always opened with prepacking (their int4 weights are small)."""
    return "MatMulNBits" in op_types


def graph_op_types(path: str | Path) -> set[str]:
    """The op types of an ONNX file, read without its external weights."""
    import onnx

    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


class ArtifactSessions:
    """Lazily opened sessions for every graph of an artifact, on the CPU EP by default."""

    def __init__(self, folder: str | Path, provider: str = "cpu", threads: int | None = None,
                 provider_options: dict[str, str] | None = None, max_resident_bytes: float | None = None,
                 share_weights: bool = False):
        """max_resident_bytes: keep at most about this many weight bytes in open sessions, closing
        the least recently used ones (the compile's checks of multi-GB models); None keeps all.
        share_weights: CPU sessions read one memory map of the weights (toolchain/runtime/shared_weights.py).
        Off by default, by measurement on SmolLM2 (1 thread, 2 widths open): Conv graphs gain nothing
        (1.88 vs 1.84 GB max RSS: onnxruntime re-lays Conv weights out per session anyway) and
        MatMulNBits needs prepacking (3.8 vs 28.7 tok/s without it)."""
        self.folder = Path(folder)
        self.max_resident_bytes = max_resident_bytes
        self.shared = SharedWeights() if share_weights and max_resident_bytes is None else None
        self.manifest = Manifest.load(self.folder)
        self.provider = provider
        self.threads = threads
        self.provider_options = provider_options or {}
        self.stages: dict[str, GraphRecord] = {g.name: g for g in self.manifest.graphs}
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._opening: dict[str, Future] = {}  # open_ahead's sessions still being opened
        # graphs the recipe already fused for the CPU EP: onnxruntime's extended fusions find nothing
        # more (measured, SmolLM2 int4 decode: the same step time at BASIC and ALL) but cost 0.1-0.2 s
        # of every start
        self.cpu_form = any(row.get("pass") in CPU_FORM_PASSES for row in self.manifest.passes or [])
        with np.load(self.folder / ROPE) as z:
            self.rope = {k: z[k] for k in z.files}

    def layout(self, family: str) -> StepLayout:
        first = self.chain(family)[0]
        return self.manifest.model.layout(first.width, first.context)

    def families(self) -> list[str]:
        return self.manifest.families()

    def chain(self, family: str) -> list[GraphRecord]:
        return self.manifest.chain(family)

    def session(self, name: str) -> ort.InferenceSession:
        if name in self._opening:
            self._sessions[name] = self._opening.pop(name).result()
        if name in self._sessions:
            self._sessions[name] = self._sessions.pop(name)  # most recently used last
        else:
            self._make_room(self.stages[name].weight_bytes)
            self._sessions[name] = self._open(name)
        return self._sessions[name]

    def open_names(self) -> set[str]:
        """Sessions open or being opened (open_ahead)."""
        return set(self._sessions) | set(self._opening)

    def open_ahead(self, names: list[str]) -> None:
        """Starts opening sessions in the background (onnxruntime releases the GIL while it builds
        one), so a caller's other start-up work (loading the tokenizer) overlaps it; `session`
        waits for them. Without a memory budget only."""
        missing = [n for n in dict.fromkeys(names) if n not in self._sessions and n not in self._opening]
        if self.max_resident_bytes is not None or not missing:
            return
        pool = ThreadPoolExecutor(max_workers=len(missing))
        for n in missing:
            self._opening[n] = pool.submit(self._open, n)
        pool.shutdown(wait=False)

    def open_many(self, names: list[str]) -> None:
        """Opens the sessions not open yet at the same time, one thread each: onnxruntime releases the
        GIL while it optimizes and prepacks a graph (measured, SmolLM2 int4: two graphs open in
        0.57 s together vs 0.63 + 0.59 s one after the other). Without a memory budget only."""
        for n in [n for n in dict.fromkeys(names) if n in self._opening]:
            self.session(n)
        missing = [n for n in dict.fromkeys(names) if n not in self._sessions]
        if self.max_resident_bytes is not None or len(missing) < 2:
            for n in missing:
                self.session(n)
            return
        with ThreadPoolExecutor(max_workers=len(missing)) as pool:
            for name, sess in zip(missing, pool.map(self._open, missing), strict=True):
                self._sessions[name] = sess

    def _open(self, name: str) -> ort.InferenceSession:
        path = str(self.folder / self.stages[name].file)
        if self.provider == "qnn":
            from toolchain.qnn import context as qnn  # optional plugin EP

            return qnn.session(path, provider="qnn", options=self.provider_options,
                               base=thread_options(ort.SessionOptions(), self.threads))
        if self.max_resident_bytes is not None:
            opts = reopenable_session_options(self.threads, prepack=prepacking_changes_numerics(graph_op_types(path)))
        else:
            opts = session_options(self.threads)
            if self.cpu_form:
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if self.shared is not None:
            self.shared.add_to(opts, Path(path))
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    @contextmanager
    def reporting_stale_kernels(self) -> Iterator[None]:
        """Around a run: mobc's CPU kernels refusing a graph compiled for an older layout of their
        inputs (kernels.is_stale_layout) becomes an ArtifactError naming the recompile command.
        Checked on failure, not at open: reading each graph's opset would cost an `import onnx`,
        ~0.8 s of start-up."""
        try:
            yield
        except Exception as exc:
            if kernels.is_stale_layout(exc):
                raise ArtifactError(
                    f"{self.folder} was compiled for an older layout of mobc's CPU kernels than this mobc's "
                    f"(mobc.cpu opset {kernels.OPSET}); " + fix_hint(self.folder, self.manifest)) from None
            raise

    def _make_room(self, needed: int) -> None:
        if self.max_resident_bytes is None:
            return
        while self._sessions:
            held = sum(self.stages[n].weight_bytes for n in self._sessions)
            if held + needed <= self.max_resident_bytes:
                return
            del self._sessions[next(iter(self._sessions))]

    def run_stage(self, stage: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.session(stage.name)
        with self.reporting_stale_kernels():
            outs = sess.run(stage.output_names, feeds)
        return dict(zip(stage.output_names, outs, strict=True))

    def run_family(self, family: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_chain(self.chain(family), feeds, self.run_stage)

    def bind(self, family: str, inputs: dict[str, np.ndarray]) -> BoundFamily:
        return BoundFamily(self, family, inputs)


class BoundFamily:
    """A family's stage chain with every input and output bound to a fixed numpy array.

    `inputs` are the family's external inputs (e.g. KVCache.buffers(width)); outputs of every
    stage are preallocated from the manifest's shapes, and a later stage's input of the same
    name is bound to that array (the chain convention of toolchain/artifact/chain.py). The
    arrays must never be replaced, only written in place.
    """

    def __init__(self, sessions: ArtifactSessions, family: str, inputs: dict[str, np.ndarray]):
        self.family = family
        self._sessions = sessions
        self.outputs: dict[str, np.ndarray] = {}
        self._runs: list[tuple[ort.InferenceSession, ort.IOBinding]] = []
        consumed: set[str] = set()
        stacked = _stacked_outputs([o for stage in sessions.chain(family) for o in stage.outputs])
        for stage in sessions.chain(family):
            sess = sessions.session(stage.name)
            binding = sess.io_binding()
            for name in stage.input_names:
                arr = self.outputs.get(name, inputs.get(name))
                if arr is None:
                    raise KeyError(f"graph {stage.name} needs input {name!r} that nothing provides")
                if not arr.flags.c_contiguous:
                    raise ValueError(f"input {name!r} of {stage.name} must be a contiguous array")
                binding.bind_cpu_input(name, arr)
                consumed.add(name)
            for out in stage.outputs:
                arr = stacked.views.get(out.name)
                if arr is None:
                    arr = np.zeros([int(d) for d in out.shape], out.numpy_dtype)
                self.outputs[out.name] = arr
                binding.bind_ortvalue_output(out.name, ort.OrtValue.ortvalue_from_numpy(arr))
            self._runs.append((sess, binding))
        # like run_chain: the family's outputs are those no later stage consumed (and KEPT_OUTPUTS)
        self.outputs = StackedRows((k, v) for k, v in self.outputs.items() if k not in consumed or k in KEPT_OUTPUTS)
        if stacked.arrays and all(name in self.outputs for name in stacked.views):
            self.outputs.stacked = stacked.arrays  # KVCache.commit copies every layer's rows at once

    def run(self) -> dict[str, np.ndarray]:
        with self._sessions.reporting_stale_kernels():
            for sess, binding in self._runs:
                sess.run_with_iobinding(binding)
        return self.outputs


class _Stacked:
    """Views of one [layers, ...] array per kind for a family's `new_key_<i>` / `new_value_<i>`
    outputs, when every layer has one and they share a shape (empty otherwise)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.views: dict[str, np.ndarray] = {}


def _stacked_outputs(outputs: list[Any]) -> _Stacked:
    found = _Stacked()
    for kind in ("new_key", "new_value"):
        by_layer = {}
        for out in outputs:
            head, _, layer = out.name.rpartition("_")
            if head == kind and layer.isdigit():
                by_layer[int(layer)] = out
        shapes = {(tuple(int(d) for d in o.shape), np.dtype(o.numpy_dtype)) for o in by_layer.values()}
        if not by_layer or sorted(by_layer) != list(range(len(by_layer))) or len(shapes) != 1:
            return _Stacked()
        shape, dtype = shapes.pop()
        found.arrays[kind] = np.zeros((len(by_layer), *shape), dtype)
        for i, out in by_layer.items():
            found.views[out.name] = found.arrays[kind][i]
    return found


def stage_feeds(sessions: ArtifactSessions, family_feeds: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each stage graph's inputs when its family's chain runs on `family_feeds[family]` (parts get
    the real residual stream their predecessor produced)."""
    feeds: dict[str, dict[str, Any]] = {}
    for family, family_in in family_feeds.items():
        def record(stage: Any, stage_in: dict[str, Any]) -> dict[str, Any]:
            feeds[stage.name] = stage_in
            return sessions.run_stage(stage, stage_in)

        run_chain(sessions.chain(family), family_in, record)
    return feeds
