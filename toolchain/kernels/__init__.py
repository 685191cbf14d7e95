"""mobc's own onnxruntime CPU kernels: a small C library of custom ops, built on first use.

Domain `mobc.cpu`:
- `MatMulQ4`: x[..., K] @ W[K, N] with W on a 4-bit block grid (GGUF's Q4_0 and Q4_1 codes, blocks of
  32; columns packed in groups of four, so a block of four columns is one 64-byte line; GGUF's
  float16 scales and offsets kept as float16) and float32 activations, i.e. the float model's
  arithmetic, several times the speed of onnxruntime's own exact (accuracy_level 0) MatMulNBits on
  one row (passes/matmul_nbits.py uses it for narrow graphs).
- `MatMulQ4I16`: the same inputs and product with each 32-block of an activation row rounded to int16
  on its own scale (error at most max|x_b| / 65534 per element) and exact integer dot products (AVX2
  pmaddwd): faster, no longer float32's arithmetic.
- `MatMulQ8I16`: a Q8_0 lm_head (GGUF's int8 codes and float16 scales, as stored) on activation
  blocks rounded to int16 the same way: the certified head's first pass (passes/certified_lm_head.py).
- `CacheAttention`: a narrow step graph's attention over the static KV cache, reading only the slots
  its mask admits (passes/cache_attention.py).
- `QKVCacheAttention`: a fused q/k/v projection's rows split into heads, queries and keys rotated and
  CacheAttention over them in one op, emitting the call's new keys and values too
  (passes/fuse_attention_prologue.py).
- `SiluMul`: a gated MLP's silu(gate) * up from the fused gate/up projection (passes/fuse_silu_mul.py).
- `CertifyArgmax`: the certified lm_head's check (ranking, rescoring, bounds, float fallback per row)
  in one call instead of a TopK, ~30 small nodes and an If (passes/certified_lm_head.py).

The sources sit beside this file; the library is compiled once per source version with the system C
compiler into $MOBC_CACHE/kernels/ (~1 s), the way llama-cpp-python compiles llama.cpp at install,
and sessions register it when it is there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from toolchain.errors import MobcError

DOMAIN = "mobc.cpu"
# the mobc.cpu opset a compiled graph declares. 2: MatMulQ4's columns in groups of four with float16 or
# float32 scales and offsets; 1 (column-major codes, float32 scales, block-major minimums) is refused
OPSET = 2
STALE_LAYOUT = "an artifact compiled before this layout needs recompiling"  # ort_ops.c says so
OPS = ("MatMulQ4", "MatMulQ4I16", "MatMulQ8I16", "CacheAttention", "QKVCacheAttention", "SiluMul", "CertifyArgmax")
BLOCK = 32
GROUP = 4  # columns per group of the packed layout (MOBC_Q4_GROUP)
MAX_K = 32768  # the longest row the op takes (MOBC_Q4_MAX_K in q4_matmul.h)
SOURCES = ("q4_matmul.c", "q8_matmul.c", "cache_attention.c", "layer_ops.c", "certificate.c", "ort_ops.c")
HEADERS = ("q4_matmul.h", "q8_matmul.h", "cache_attention.h", "layer_ops.h", "certificate.h", "vexp.h", "ort_abi.h")
LIBS = ("-lm",)  # after the sources, so the linker keeps them
_HERE = Path(__file__).parent
_lock = threading.Lock()
_built: dict[str, Path | str] = {}


class KernelBuildError(MobcError):
    """mobc's CPU kernel library cannot be built or loaded on this machine."""


def _cache_root() -> Path:
    return Path(os.environ.get("MOBC_CACHE", Path.home() / ".cache" / "mobc")) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _flags() -> list[str]:
    return ["-O3", "-shared", "-fPIC", "-std=c11", "-Wall", "-Wno-unused-function"]


@functools.cache  # the sources of an installed package do not change under a running process
def _digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + (_HERE / name).read_bytes())
    h.update(" ".join(_flags() + list(LIBS)).encode() + platform.machine().encode())
    return h.hexdigest()[:16]


def _build(target: Path) -> None:
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (cc, gcc or clang) to build mobc's CPU kernels; install "
                               "one (Debian: apt install gcc) or set CC, or compile the recipe without the "
                               "passes that emit them (`matmul_nbits: {kernel_rows: ...}`, `cache_attention`, "
                               "`fuse_attention_prologue`, `fuse_silu_mul`, "
                               "`certified_lm_head: {activations: int16}` or `{certificate: op}`)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *_flags(), "-o", str(out), *(str(_HERE / s) for s in SOURCES), *LIBS]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelBuildError(f"building mobc's CPU kernels failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
        os.replace(out, target)  # atomic: a concurrent process sees the whole library or none


def library() -> Path:
    """The kernel library for these sources, built on first use; raises KernelBuildError."""
    key = _digest()
    with _lock:
        got = _built.get(key)
        if isinstance(got, str):
            raise KernelBuildError(got)
        if got is not None:
            return got
        target = _cache_root() / key / ("mobc_kernels.dll" if sys.platform == "win32" else "libmobc_kernels.so")
        try:
            if not target.exists():
                _build(target)
        except KernelBuildError as exc:
            _built[key] = str(exc)
            raise
        _built[key] = target
        return target


def available() -> bool:
    try:
        library()
        return True
    except KernelBuildError:
        return False


def register(so) -> bool:
    """Registers the kernels with onnxruntime SessionOptions `so` when they can be built; a graph
    that needs them and finds them missing fails in `require` with the reason."""
    try:
        so.register_custom_ops_library(str(library()))
        return True
    except KernelBuildError:
        return False


def is_stale_layout(exc: BaseException) -> bool:
    """Whether onnxruntime failed because a MatMulQ4 graph holds an older layout of its inputs (the
    op's own message, toolchain/kernels/ort_ops.c)."""
    return STALE_LAYOUT in str(exc)


def require(what: str) -> None:
    """Fails with the build's reason when `what` needs the kernels and they cannot be built."""
    try:
        library()
    except KernelBuildError as exc:
        raise KernelBuildError(f"{what} needs mobc's CPU kernels: {exc}") from None
