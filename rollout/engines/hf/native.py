"""The engine's C kernels (attention, rotary embedding, RMSNorm, the gated MLP's activation):
built once per machine with the system C compiler, called through ctypes.

Plain C with no torch headers, so a build takes about a second (a torch C++ extension
takes a minute) and needs only ``cc``. The library lives in
``$HOMEGYM_CACHE/kernels/<hash>/``, keyed by the source, the compiler flags and this CPU's
model and flags (it is built with ``-march=native`` unless ``HOMEGYM_NATIVE_MARCH`` names
another target, so a cache shared across different machines gets one build per CPU kind).
No compiler, a failed build, or ``HOMEGYM_NATIVE_KERNELS=0``: ``load()`` returns None and
callers keep their torch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from rollout.models import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "kernels.c"
# The instruction set the kernels are built for: this CPU's by default. Another target
# (``HOMEGYM_NATIVE_MARCH=haswell``: AVX2 and FMA, no AVX-512) builds what an older CPU would
# run, e.g. to measure an AVX2-only box's kernels on an AVX-512 one
# (docs/performance.md, with torch's and MKL's own dispatch held to AVX2 the same way).
MARCH = os.environ.get("HOMEGYM_NATIVE_MARCH", "native")
CFLAGS = ["-O3", f"-march={MARCH}", "-ffast-math", "-fopenmp-simd", "-fPIC", "-shared"]
if platform.machine() in ("x86_64", "AMD64"):
    # Compilers keep auto-vectorized loops at 256 bits on AVX-512 cores by default (older
    # Intel cores clocked down for 512-bit work); at 512 the MLP activation ran 1.4x and
    # RMSNorm 1.1x faster on an Intel Xeon with AMX, one thread. No effect on AVX2 cores.
    CFLAGS.insert(2, "-mprefer-vector-width=512")

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


BUILD_TIMEOUT_S = 120


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``, else ``gcc``."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # A build killed outright (SIGKILL, a machine going down) leaves its temporary file; any
    # older than a build may take is such a leftover, not a concurrent build's.
    for stale in out.parent.glob("tmp*.so"):
        try:
            if time.time() - stale.stat().st_mtime > 2 * BUILD_TIMEOUT_S:
                stale.unlink()
        except OSError:
            pass
    # Build beside the target, then rename: concurrent engines never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernels, building them on first use; None where they are unavailable."""
    global _lib, _tried
    if _tried:  # every kernel call asks (~30 a decode step): no lock once decided
        return _lib
    with _lock:
        if not _tried:
            _lib = _build_and_load()
            _tried = True
        return _lib


def _build_and_load() -> Optional[ctypes.CDLL]:
    if os.environ.get("HOMEGYM_NATIVE_KERNELS", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: the engine uses its torch decode attention")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *CFLAGS]).encode()
                         + _cpu_id().encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / key / "libhomegym_kernels.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the engine's C kernels failed (%s): using the torch path",
                    detail)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.homegym_decode_attention.argtypes = [ptr] * 5 + [i64] * 12 + [ctypes.c_float] * 2
    lib.homegym_decode_attention.restype = ctypes.c_int
    lib.homegym_varlen_causal_attention.argtypes = [ptr] * 5 + [i64] * 4 + [ctypes.c_float]
    lib.homegym_varlen_causal_attention.restype = ctypes.c_int
    lib.homegym_silu_mul.argtypes = [ptr] * 2 + [i64]
    lib.homegym_silu_mul.restype = None
    lib.homegym_rope.argtypes = [ptr] * 3 + [i64] * 3
    lib.homegym_rope.restype = None
    lib.homegym_rms_norm.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_float]
    lib.homegym_rms_norm.restype = None
    lib.homegym_decode_layers.argtypes = ([ptr] * 3 + [i64] + [ptr] + [i64] * 6 + [ptr] * 3
                                          + [i64] * 5 + [ctypes.c_float])
    lib.homegym_decode_layers.restype = ctypes.c_int
    return lib
