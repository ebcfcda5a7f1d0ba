#!/usr/bin/env bash
# Install the real SGLang server (0.5.18) for CPU into its own venv.
#
#   bash scripts/install_sglang_cpu.sh VENV_DIR KERNEL
#
#   VENV_DIR  the venv to create or complete; only the SGLang server runs with its
#             interpreter (homegym starts it as a subprocess), never the project venv.
#   KERNEL    the SGLang CPU kernel (sglang-kernel-cpu 0.4.6.post1): a wheel, a source
#             tarball of python/sglang/kernels/aot, or a folder holding either (the wheel
#             is preferred when it fits this Python). Source is built here (4-15 min on 2 cores).
#
# What it does, in order: checks the CPU (AVX-512 and AMX), installs missing apt
# packages, creates the venv, installs torch==2.13.0 (CPU) first, then the CPU
# dependencies in scripts/sglang-cpu-requirements.txt constrained to that torch,
# sglang==0.5.18 --no-deps, torchvision 0.28.0 plus a small compatibility package
# (see below), and the kernel --no-deps. It never replaces torch: a venv holding any
# other torch is an error. A stamp in VENV_DIR makes a rerun with the same inputs instant.
#
# torchvision: sglang imports torchvision.io at start-up (sglang/srt/utils/common.py),
# so it must be importable. PyPI's torchvision 0.28.0 (the release paired with torch
# 2.13.0) is a CUDA build: its _C.so needs libtorch_cuda.so, does not load against CPU
# torch, and then `import torchvision` dies in _meta_registrations.py because
# register_fake("torchvision::nms") needs the op to exist. The package
# sglang-cpu-torchvision-compat written below hooks torch's documented extension
# autoload (entry-point group "torch.backends", run at the end of `import torch`) and,
# only when torchvision's _C.so cannot be loaded, defines the schemas of
# torchvision::nms and torchvision::qnms (no kernels). `import torchvision` then works:
# its pure-Python parts (transforms, io wrappers) are the real ones, its C++ ops report
# "Couldn't load custom C++ ops" as for any build without them. No installed file is
# edited and no .pth file is used.
#
# Exit status: 0 installed (or already up to date), 2 usage error, 3 this CPU cannot
# run the SGLang CPU kernels (the message starts with "skipped:"), 1 anything else.
#
# Environment: PYTHON (interpreter for a new venv, default python3.11),
# FORCE=1 (ignore the stamp), CMAKE_BUILD_PARALLEL_LEVEL (source build, default nproc),
# SGLANG_CPU_CPUINFO (a file read instead of /proc/cpuinfo, to test the CPU check).
set -euo pipefail

SGLANG_VERSION=0.5.18
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
KERNEL_VERSION=0.4.6.post1

T0=$(date +%s)
log() { printf '[install_sglang_cpu +%ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { printf '[install_sglang_cpu] error: %s\n' "$*" >&2; exit 1; }

if [ $# -ne 2 ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
VENV_DIR=$(realpath -m "$1")  # absolute: the source build runs pip from another folder
KERNEL_ARG=$2
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQS="$SCRIPT_DIR/sglang-cpu-requirements.txt"
[ -f "$REQS" ] || die "missing $REQS"

# --- 1. CPU --------------------------------------------------------------------------
# The CPU kernels are built with -march=x86-64-v4 and AMX tile instructions.
CPUINFO=${SGLANG_CPU_CPUINFO:-/proc/cpuinfo}  # overridable only to test this check
missing_flags=()
for flag in avx512f amx_tile; do
    grep -qw "$flag" "$CPUINFO" 2>/dev/null || missing_flags+=("$flag")
done
if [ ${#missing_flags[@]} -gt 0 ]; then
    echo "skipped: this CPU lacks ${missing_flags[*]} ($CPUINFO); the SGLang CPU kernels need avx512f and amx_tile"
    exit 3
fi

# --- 2. which kernel -----------------------------------------------------------------
PYTHON=${PYTHON:-python3.11}
if [ -x "$VENV_DIR/bin/python" ]; then PYBIN="$VENV_DIR/bin/python"; else PYBIN=$(command -v "$PYTHON") || die "no $PYTHON on PATH (set PYTHON=...)"; fi
PYTAG=$("$PYBIN" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

KERNEL_WHEEL=""; KERNEL_SRC=""
if [ -d "$KERNEL_ARG" ]; then
    KERNEL_WHEEL=$(ls -1 "$KERNEL_ARG"/sglang_kernel_cpu-*-"$PYTAG"-*linux_x86_64.whl 2>/dev/null | sort | tail -n 1 || true)
    if [ -z "$KERNEL_WHEEL" ]; then
        KERNEL_SRC=$(ls -1 "$KERNEL_ARG"/sglang-kernel-cpu*.tar.gz "$KERNEL_ARG"/sglang-kernel-cpu*.tgz 2>/dev/null | sort | tail -n 1 || true)
    fi
    [ -n "$KERNEL_WHEEL$KERNEL_SRC" ] || die "$KERNEL_ARG holds no sglang_kernel_cpu-*-$PYTAG-*.whl and no sglang-kernel-cpu*.tar.gz"
elif [ -f "$KERNEL_ARG" ]; then
    case "$KERNEL_ARG" in
        *.whl)            KERNEL_WHEEL=$KERNEL_ARG ;;
        *.tar.gz|*.tgz)   KERNEL_SRC=$KERNEL_ARG ;;
        *) die "KERNEL must be a .whl, a .tar.gz source tarball or a folder: $KERNEL_ARG" ;;
    esac
else
    die "KERNEL not found: $KERNEL_ARG"
fi
if [ -n "$KERNEL_WHEEL" ]; then
    case "$(basename "$KERNEL_WHEEL")" in
        *-"$PYTAG"-*) ;;
        *) die "kernel wheel $(basename "$KERNEL_WHEEL") does not fit this Python ($PYTAG)" ;;
    esac
fi
KERNEL_FILE=$(realpath "${KERNEL_WHEEL:-$KERNEL_SRC}")
KERNEL_SHA=$(sha256sum "$KERNEL_FILE" | cut -d' ' -f1)

# --- 3. stamp ------------------------------------------------------------------------
STAMP="$VENV_DIR/.sglang-cpu-installed"
KEY=$(cat "$0" "$REQS" <(echo "$KERNEL_SHA $PYTAG") | sha256sum | cut -d' ' -f1)
if [ "${FORCE:-0}" != 1 ] && [ -x "$VENV_DIR/bin/python" ] && [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$KEY" ]; then
    log "up to date: $VENV_DIR (stamp $STAMP; FORCE=1 to redo)"
    exit 0
fi
log "installing SGLang $SGLANG_VERSION for CPU into $VENV_DIR"
log "kernel: $KERNEL_FILE ($( [ -n "$KERNEL_WHEEL" ] && echo wheel || echo "source, to be built"))"

# --- 4. apt packages -----------------------------------------------------------------
# libnuma1: the kernel's common_ops.so links libnuma.so.1; numactl: SGLang's NUMA binding;
# libtcmalloc-minimal4 / libtbbmalloc2: the allocators SGLang's CPU guide LD_PRELOADs.
# Building from source also needs the libnuma headers and a C++ compiler.
APT_PKGS=(libnuma1 numactl libtcmalloc-minimal4 libtbbmalloc2)
if [ -n "$KERNEL_SRC" ]; then
    APT_PKGS+=(libnuma-dev)
    command -v g++ >/dev/null || APT_PKGS+=(g++)
    command -v cmake >/dev/null || APT_PKGS+=(cmake)
fi
apt_missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || apt_missing+=("$p")
done
if [ ${#apt_missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "apt-get install ${apt_missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
    else
        die "missing system packages: ${apt_missing[*]} (install them as root: apt-get install ${apt_missing[*]})"
    fi
else
    log "apt packages present: ${APT_PKGS[*]}"
fi

# --- 5. venv and torch ---------------------------------------------------------------
if [ ! -x "$VENV_DIR/bin/python" ]; then
    log "creating venv $VENV_DIR with $PYBIN"
    "$PYBIN" -m venv "$VENV_DIR"
fi
VPY="$VENV_DIR/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
# pip() drops pip's warnings about configured file:// indexes that lack a package folder.
pip() { "${PIP[@]}" "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }
torch_version() { "$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true; }

CONSTRAINTS="$VENV_DIR/.sglang-cpu-constraints.txt"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$CONSTRAINTS"

have=$(torch_version)
case "$have" in
    "") log "pip install torch==$TORCH_VERSION"
        pip install -q "torch==$TORCH_VERSION" ;;
    "$TORCH_VERSION"|"$TORCH_VERSION"+*) log "torch $have already installed" ;;
    *) die "$VENV_DIR holds torch $have, not $TORCH_VERSION; this script never replaces torch (use a fresh VENV_DIR)" ;;
esac
TORCH_HAVE=$(torch_version)
"$VPY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)' \
    || die "torch $TORCH_HAVE in $VENV_DIR is a CUDA build; the SGLang CPU server needs the CPU build of torch $TORCH_VERSION"
check_torch() {
    [ "$(torch_version)" = "$TORCH_HAVE" ] || die "torch changed during '$1' ($TORCH_HAVE -> $(torch_version))"
}

# --- 6. dependencies, sglang, torchvision --------------------------------------------
log "pip install -r $(basename "$REQS") (constrained to torch==$TORCH_VERSION)"
pip install -q -c "$CONSTRAINTS" -r "$REQS"
check_torch "requirements"

log "pip install --no-deps sglang==$SGLANG_VERSION"
pip install -q --no-deps "sglang==$SGLANG_VERSION"

log "pip install torchvision==$TORCHVISION_VERSION and sglang-cpu-torchvision-compat"
pip install -q -c "$CONSTRAINTS" "torchvision==$TORCHVISION_VERSION"
check_torch "torchvision"
COMPAT_DIR=$(mktemp -d)
trap 'rm -rf "$COMPAT_DIR"' EXIT
mkdir -p "$COMPAT_DIR/src"
cat > "$COMPAT_DIR/pyproject.toml" <<'EOF'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "sglang-cpu-torchvision-compat"
version = "1.0"
description = "Lets PyPI's CUDA torchvision import against CPU torch (defines torchvision::nms/qnms schemas when torchvision's _C.so cannot load)"
requires-python = ">=3.10"

[project.entry-points."torch.backends"]
sglang_cpu_torchvision_compat = "sglang_cpu_torchvision_compat:autoload"

[tool.setuptools]
package-dir = {"" = "src"}
py-modules = ["sglang_cpu_torchvision_compat"]
EOF
cat > "$COMPAT_DIR/src/sglang_cpu_torchvision_compat.py" <<'EOF'
"""Make `import torchvision` work when torchvision's C++ extension cannot load.

PyPI's torchvision wheels for Linux x86_64 are CUDA builds; against CPU torch their
_C.so fails to load (it needs libtorch_cuda.so). torchvision then skips its C++ ops,
but torchvision/_meta_registrations.py still calls
torch.library.register_fake("torchvision::nms") (and "::qnms"), which raises
"operator torchvision::nms does not exist" and aborts `import torchvision`.

torch calls autoload() at the end of `import torch` (entry-point group
"torch.backends"). Only when torchvision is installed and its _C.so does not load,
it defines the two schemas, without kernels, so that import succeeds; torchvision's
C++ ops stay unavailable, exactly as torchvision reports them.
"""

import ctypes
import importlib.util
import os

_LIB = None  # keeps the definitions alive (a Library deregisters them when collected)


def autoload():
    global _LIB
    try:
        if _LIB is not None:
            return
        spec = importlib.util.find_spec("torchvision")  # does not import torchvision
        if spec is None or not spec.submodule_search_locations:
            return
        so = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
        if not os.path.exists(so):
            return
        try:
            ctypes.CDLL(so)  # what torchvision's own torch.ops.load_library would do
            return  # it loads: torchvision defines its ops itself
        except OSError:
            pass
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in ("nms", "qnms"):
            try:
                lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass  # already defined
        _LIB = lib
    except Exception:  # never break `import torch`
        pass
EOF
pip install -q --no-deps --no-build-isolation --force-reinstall "$COMPAT_DIR"

# --- 7. kernel -----------------------------------------------------------------------
if [ -n "$KERNEL_SRC" ]; then
    WHEEL_CACHE="$VENV_DIR/.sglang-kernel-cpu-build/$KERNEL_SHA"
    KERNEL_WHEEL=$(ls -1 "$WHEEL_CACHE"/sglang_kernel_cpu-*.whl 2>/dev/null | head -n 1 || true)
    if [ -n "$KERNEL_WHEEL" ]; then
        log "kernel already built from this source: $KERNEL_WHEEL"
    else
        log "building the kernel from $KERNEL_SRC (4-15 min on 2 cores)"
        tb=$(date +%s)
        pip install -q -c "$CONSTRAINTS" "scikit-build-core>=0.10" wheel numpy
        BUILD_DIR="$VENV_DIR/.sglang-kernel-cpu-build/src"
        rm -rf "$BUILD_DIR"; mkdir -p "$BUILD_DIR"
        tar xzf "$KERNEL_SRC" -C "$BUILD_DIR"
        AOT=$(dirname "$(find "$BUILD_DIR" -name pyproject_cpu.toml -print -quit)")
        [ -f "$AOT/pyproject_cpu.toml" ] || die "no pyproject_cpu.toml in $KERNEL_SRC"
        cp "$AOT/pyproject_cpu.toml" "$AOT/pyproject.toml"
        mkdir -p "$WHEEL_CACHE"
        (cd "$AOT" && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
            pip wheel -q --no-build-isolation --no-deps -c "$CONSTRAINTS" -w "$WHEEL_CACHE" .)
        rm -rf "$BUILD_DIR"
        KERNEL_WHEEL=$(ls -1 "$WHEEL_CACHE"/sglang_kernel_cpu-*.whl | head -n 1)
        log "built $(basename "$KERNEL_WHEEL") in $(( $(date +%s) - tb ))s"
    fi
fi
log "pip install --no-deps $(basename "$KERNEL_WHEEL")"
pip install -q --no-deps --force-reinstall "$KERNEL_WHEEL"
check_torch "kernel"

# --- 8. check ------------------------------------------------------------------------
log "checking the installation"
SGLANG_USE_CPU_ENGINE=1 "$VPY" - "$SGLANG_VERSION" "$KERNEL_VERSION" <<'EOF'
import importlib.metadata as m
import sys

import torch
import torchvision
import sgl_kernel  # noqa: F401  registers torch.ops.sgl_kernel
import sglang.srt.utils.common  # noqa: F401  what the server imports first (triton, torchvision.io)

want_sglang, want_kernel = sys.argv[1:3]
assert torch.version.cuda is None, "torch is a CUDA build"
assert m.version("sglang") == want_sglang, m.version("sglang")
assert m.version("sglang-kernel-cpu") == want_kernel, m.version("sglang-kernel-cpu")
assert hasattr(torch.ops.sgl_kernel, "weight_packed_linear"), "CPU kernel ops missing"
print(f"  torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"sglang {m.version('sglang')}, sglang-kernel-cpu {m.version('sglang-kernel-cpu')}")
EOF

echo "$KEY" > "$STAMP"
{ echo "sglang==$SGLANG_VERSION torch==$TORCH_HAVE torchvision==$TORCHVISION_VERSION"; echo "kernel $KERNEL_FILE sha256 $KERNEL_SHA"; date -u +%FT%TZ; } >> "$STAMP"
log "done in $(( $(date +%s) - T0 ))s. Launch: SGLANG_USE_CPU_ENGINE=1 LD_PRELOAD=$VENV_DIR/lib/libiomp5.so $VPY -m sglang.launch_server --device cpu --dtype bfloat16 --max-total-tokens N --model-path M ..."
