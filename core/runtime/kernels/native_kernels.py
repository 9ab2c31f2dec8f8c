"""The native decode kernels (core/runtime/kernels/native/decode_kernels.c): compiled at first use, loaded through ctypes.

The C file is built with the machine's C compiler (CC, else cc or gcc) into the user cache folder (or the folder
HIVEKEEPER_KERNEL_CACHE names, which the test suite shares between its processes), once per source,
compiler and flags (the file name carries their hash; the build goes to a temporary name and is renamed into place,
so processes starting together never load a half-written library). Three builds exist (VARIANTS): "avx512vnni"
(AVX2 and AVX512-VNNI: the quantized products' integer dot products in one instruction), "avx2" (AVX2, FMA and F16C
intrinsics) and "portable" (plain C for any CPU). The best one the CPU flags (HIVEKEEPER_CPU_FLAGS when pinned) and
the real CPU allow is chosen; HIVEKEEPER_NATIVE=<build> asks for one (the tests run each the CPU runs);
HIVEKEEPER_NATIVE_PROFILE=1 builds it with -DHK_PROFILE, which times a decode step's parts (`step_profile`).
Without a compiler, or with HIVEKEEPER_NATIVE=0, `library()` is None and decoding runs the numpy path
(core/runtime/kernels/cpu_decode.py); `status()` says which and why. The first build takes seconds (COMPILING):
`needs_build()` tells beforehand and `load_saying(say)` says so, for `chat`, `generate` and the app's Chat page.

The kernels' pool hands work out in chunks that any awake thread claims, and never waits for a worker that has not
started (a worker the OS took off its core, on a busy machine); `hk_test_hold_worker` holds one back on purpose for
the tests of that. A product that had to wait for a worker that lost its core mid-chunk, soon after another such
wait, makes the next products run on the caller alone for a while (`hk_pool_stalls` counts the stalls): one core's
speed instead of a stall each. A stall on its own (a quiet machine's) leaves the pool in use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from hivekeeper.core.machine.cpu_features import FLAGS_ENV, cpu_flags, native_kernel_flags_missing, pinned_flags
from hivekeeper.core.runtime.kernels.cpu_threads import blas_threads, physical_cores

SOURCE = Path(__file__).with_name("native") / "decode_kernels.c"
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-pthread")
VARIANTS = {  # build name -> its instruction-set flags, the best first
    "avx512vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
}
# the CPU flags (as /proc/cpuinfo spells them; numpy's names) a build needs beyond AVX2, FMA and F16C
VARIANT_FLAGS = {"avx512vnni": (("avx512f", "AVX512F"), ("avx512bw", "AVX512BW"), ("avx512vl", "AVX512VL"),
                                ("avx512_vnni", "AVX512VNNI")), "avx2": ()}
VARIANT_ENV = "HIVEKEEPER_NATIVE"  # 0/off: no kernels; a build's name: that build where the CPU runs it;
#                                    unset/1/auto: the CPU's best
CACHE_ENV = "HIVEKEEPER_KERNEL_CACHE"  # a folder for the builds instead of the user cache (shared by processes)
PROFILE_ENV = "HIVEKEEPER_NATIVE_PROFILE"  # 1: a build that times the parts of a decode step (bench/decode_profile.py)
PROFILE_PARTS = ("norm", "qkv", "rope", "attention", "o", "gate_up", "silu", "down", "head", "quantize", "wait",
                 "solo")  # decode_kernels.c's P_* parts, in their order
OFF_VALUES = ("0", "off", "false", "no")

ENABLED = True  # tests and benchmarks switch it off to run the numpy path in the same process
DEFAULT_SPIN_SECONDS = 50e-6  # how long an idle pool worker spins before it sleeps (bench/decode_busy.py measures)
MAX_ROWS = 8  # batch rows the kernels take (decode_kernels.c's MAX_ROWS); more are not memory-bound: BLAS's job
QUANT_MAX_ROWS = 512  # rows one block-quantized product takes (decode_kernels.c's QUANT_MAX_ROWS): a prefill's prompt

# what a command or the app says while the first library() call compiles (2-core VM: 8 s at load 0.2, 9-18 s in a busy
# app, 73 s niced at load 9)
COMPILING = "compiling the CPU decode kernels for this machine (once per install: 10-20 s, longer when busy)…"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status: str | None = None


class Block(ctypes.Structure):
    """hk_block: one layer's shapes and weight addresses (the arrays must outlive it); `formats` holds each weight's
    block format (GGML type id, 0 for fp32) in bytes 0-3: qkv, o, gate_up, down."""

    _fields_ = [(name, ctypes.c_long) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_double), ("eps2", ctypes.c_double),
    ] + [(name, ctypes.c_void_p) for name in ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b", "down_w",
                                              "down_b")] + [("column_major", ctypes.c_long), ("formats", ctypes.c_long)]


class Cache(ctypes.Structure):
    """hk_cache: one block's K/V caches and its sliding window (0: none)."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("batch_stride", ctypes.c_long),
                ("head_stride", ctypes.c_long), ("position_stride", ctypes.c_long), ("window", ctypes.c_long)]


class Token(ctypes.Structure):
    """hk_token: the new token's position and its rotary tables."""

    _fields_ = [("position", ctypes.c_long), ("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p)]


def _numpy_cpu_features() -> dict:
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as features
    return features


def _cpu_supported(variant: str = "avx2") -> str | None:
    """None when the CPU runs `variant` ("avx2": x86-64 with AVX2, FMA and F16C; "avx512vnni": those and
    AVX512F/BW/VL/VNNI), else why not.

    The flags pinned by HIVEKEEPER_CPU_FLAGS (core/machine/cpu_features.py) can rule a build out; the real CPU
    (as numpy sees it) must also have them, since the kernels execute those instructions (F16C, which every AVX2 CPU
    has, is checked on the real CPU only)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are written for x86-64, this CPU is {platform.machine()}"
    pinned = f" (flags pinned by {FLAGS_ENV})" if pinned_flags() is not None else ""
    flags = cpu_flags()
    missing = native_kernel_flags_missing() + [flag for flag, _ in VARIANT_FLAGS[variant] if flag not in flags]
    if missing:
        return f"this CPU lacks {' and '.join(flag.upper() for flag in missing)}{pinned}"
    features = _numpy_cpu_features()
    wanted = ("AVX2", "FMA3", "F16C", *(name for _, name in VARIANT_FLAGS[variant]))
    missing = [flag for flag in wanted if not features.get(flag)]
    return f"this CPU lacks {' and '.join(missing)}" if missing else None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    """Where the builds live: HIVEKEEPER_KERNEL_CACHE when set (the test suite points all its processes at one folder,
    so the kernels compile once per run whatever XDG_CACHE_HOME each process has), else the user cache folder."""
    shared = os.environ.get(CACHE_ENV, "").strip()
    if shared:
        return Path(shared)
    import platformdirs

    return Path(platformdirs.user_cache_dir("hivekeeper")) / "native"


def _compiler_identity(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return compiler


def build(compiler: str, out_dir: Path, variant: str = "avx2", profile: bool = False) -> Path:
    """Compile the kernels' `variant` build with `compiler` into out_dir (reused when already built); `profile`: the
    build that times a decode step's parts (hk_profile). Raises RuntimeError with the compiler's message when the
    build fails."""
    flags = _flags(variant, profile)
    target = _target(compiler, out_dir, variant, profile)
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=out_dir, prefix=".build-", suffix=".so")
    os.close(handle)
    try:
        try:
            result = subprocess.run([compiler, *flags, str(SOURCE), "-o", partial, "-lm"], capture_output=True,
                                    text=True, timeout=300)
        except FileNotFoundError:
            raise RuntimeError(f"the C compiler {compiler!r} was not found (set CC, or install gcc)") from None
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _flags(variant: str, profile: bool) -> tuple[str, ...]:
    return (*FLAGS, *VARIANTS[variant], *(("-DHK_PROFILE",) if profile else ()))


def _target(compiler: str, out_dir: Path, variant: str, profile: bool) -> Path:
    """Where `build` puts the variant's library: the name carries a hash of the source, flags and compiler."""
    flags = _flags(variant, profile)
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join((*flags, _compiler_identity(compiler))).encode()).hexdigest()
    return out_dir / f"decode_kernels-{variant}{'-profile' if profile else ''}-{key[:16]}.so"


def needs_build() -> bool:
    """Whether the first `library()` call of this process will compile the kernels (COMPILING: seconds), so that a
    command or the app can say so first. False once decided, when switched off or without a compiler, and when the
    chosen build is already in the cache."""
    if _status is not None:
        return False
    variant, _ = chosen_variant()
    compiler = _compiler()
    if variant is None or compiler is None:
        return False
    return not _target(compiler, _cache_dir(), variant, profiling()).is_file()


def load_saying(say: Callable[[str], None]) -> float | None:
    """Load the kernels (`library`); when that compiles them, call say(COMPILING) first and return the seconds the
    compile took (None when nothing was compiled)."""
    if not needs_build():
        library()
        return None
    say(COMPILING)
    started = time.perf_counter()
    library()
    return time.perf_counter() - started


def chosen_variant() -> tuple[str | None, str]:
    """(the build to load, why): None when HIVEKEEPER_NATIVE switches the kernels off."""
    asked = os.environ.get(VARIANT_ENV, "auto").strip().lower()
    if asked in OFF_VALUES:
        return None, f"{VARIANT_ENV}={asked}"
    if asked == "portable":
        return "portable", f"{VARIANT_ENV}=portable"
    candidates = [asked] if asked in VARIANT_FLAGS else list(VARIANT_FLAGS)  # a named build, else the best first
    reasons = []
    for variant in candidates:
        unsupported = _cpu_supported(variant)
        if unsupported is None:
            return variant, f"{VARIANT_ENV}={asked}" if asked in VARIANT_FLAGS else ""
        reasons.append(f"{variant}: {unsupported}")
    return "portable", "; ".join(reasons)


def _load() -> tuple[ctypes.CDLL | None, str]:
    variant, why = chosen_variant()
    if variant is None:
        return None, f"off ({why})"
    compiler = _compiler()
    if compiler is None:
        return None, "off: no C compiler found (set CC, or install gcc)"
    try:
        path, library = _build_and_open(compiler, variant)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        if variant != "avx512vnni" or os.environ.get(VARIANT_ENV, "").strip().lower() == variant:
            return None, f"off: {error}"
        variant, why = "avx2", f"the avx512vnni build failed ({str(error)[:200]})"  # an older compiler: AVX2 then
        try:
            path, library = _build_and_open(compiler, variant)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            return None, f"off: {error}"
    _declare(library)
    library.hk_set_spin(DEFAULT_SPIN_SECONDS)
    threads = library.hk_set_threads(default_threads())
    return library, f"on ({threads} threads, {variant}{': ' + why if why else ''}, {path.name})"


def _build_and_open(compiler: str, variant: str) -> tuple[Path, ctypes.CDLL]:
    path = build(compiler, _cache_dir(), variant, profile=profiling())
    return path, ctypes.CDLL(str(path))


def profiling() -> bool:
    """Whether HIVEKEEPER_NATIVE_PROFILE asks for the build that times a decode step's parts."""
    return os.environ.get(PROFILE_ENV, "").strip() == "1"


def _declare(library: ctypes.CDLL) -> None:
    """The exported functions' argument and result types."""
    void_p, long, integer = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    signatures = {
        "hk_set_threads": ([integer], integer), "hk_set_spin": ([ctypes.c_double], ctypes.c_double),
        "hk_test_hold_worker": ([integer, ctypes.c_double, integer], None), "hk_test_release_worker": ([], None),
        "hk_test_worker_held": ([], integer), "hk_test_worker_holds": ([], long),
        "hk_test_count_chunks": ([long, void_p], None), "hk_variant": ([], ctypes.c_char_p),
        "hk_gemv": ([void_p, integer, void_p, void_p, void_p, long, long, long], integer),
        "hk_span_decode": ([ctypes.POINTER(Block), ctypes.POINTER(Cache), long, ctypes.POINTER(Token), void_p, long],
                           integer),
        "hk_span_decode_rows": ([ctypes.POINTER(Block), ctypes.POINTER(Cache), long, ctypes.POINTER(Token), void_p,
                                 long], integer),
        "hk_norm_gemv": ([void_p, ctypes.c_double, void_p, integer, void_p, void_p, long, long, long], integer),
        "hk_quant_block_bytes": ([integer], long), "hk_quant_max_rows": ([], long),
        "hk_qgemv": ([integer, void_p, void_p, void_p, void_p, long, long, long], integer),
        "hk_dequantize": ([integer, void_p, void_p, long, long], integer),
        "hk_pool_stalls": ([], long), "hk_pool_solo_left": ([], long), "hk_set_solo": ([long], long),
        "hk_set_attention_pool": ([long], long), "hk_attention_bytes": ([integer], long),
        **({"hk_profile": ([integer], ctypes.c_double)} if profiling() else {}),
    }
    for name, (arguments, result) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result


def default_threads() -> int:
    """The pool's size: the physical cores, or fewer when OPENBLAS_NUM_THREADS / OMP_NUM_THREADS say so."""
    return min(physical_cores(), blas_threads())


def set_spin_seconds(seconds: float) -> None:
    """How long the pool's idle workers spin before they sleep (benchmarks compare budgets); no-op when off."""
    if (native := library()) is not None:
        native.hk_set_spin(seconds)


def set_solo_products(products: int) -> None:
    """How many products run on the caller alone after one stalled on a late worker (0: none; benchmarks compare
    settings); no-op when off."""
    if (native := library()) is not None:
        native.hk_set_solo(products)


def attention_bytes(reset: bool = False) -> int | None:
    """Bytes of K and V rows the kernels' attention has read since the last reset (each pass over a run of keys
    counting its rows once: a step reads its cache's bytes once where a KV head serves up to 4 query heads), then
    zeroed when `reset`; None when the kernels are off."""
    native = library()
    return None if native is None else native.hk_attention_bytes(int(reset))


def set_attention_pool(products: int) -> None:
    """From what size (batch x keys x heads x head_dim) a step's attention runs over the pool (0: always; benchmarks
    compare settings); no-op when off."""
    if (native := library()) is not None:
        native.hk_set_attention_pool(products)


def step_profile(reset: bool = False) -> dict[str, float] | None:
    """The caller's CPU seconds per part of the decode steps so far (PROFILE_PARTS), then zeroed when `reset`; None
    unless the profiling build is loaded (HIVEKEEPER_NATIVE_PROFILE=1)."""
    native = library()
    if native is None or not hasattr(native, "hk_profile"):
        return None
    parts = {name: native.hk_profile(i) for i, name in enumerate(PROFILE_PARTS)}
    if reset:
        native.hk_profile(-1)
    return parts


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (see `status`). Built and loaded once per process."""
    global _library, _status
    if _status is None:
        with _lock:
            if _status is None:
                _library, _status = _load()
    return _library if ENABLED else None


def forget() -> None:
    """Decide again at the next call (after the pinned CPU flags or HIVEKEEPER_NATIVE changed: tests do). The
    library loaded before stays loaded (ctypes cannot unload it), idle."""
    global _library, _status
    with _lock:
        _library, _status = None, None


def status() -> str:
    """'on (...)' or 'off: <why>' for benchmarks and `hivekeeper detect`."""
    library()
    return _status or ""
