"""Building the small C++ CPU kernels: torch's cpp_extension (ninja + the system C++ compiler), once per machine.

Each build lands in its own folder of our cache (~/.cache/deltaserve/kernels, or $DELTASERVE_KERNEL_CACHE), named
by a hash of everything that shapes the binary: the source, the flags, the compiler and its version, torch, Python
and the folder torch is installed in. Two virtual environments, two compilers or an AVX2 build beside the native one
therefore never build over each other. A build runs in a private temporary folder and is renamed into place whole,
so an interrupted build (Ctrl-C, a closed terminal, kill -9) leaves nothing half-built behind; the lock beside the
folder names the builder's pid and host, and a later start takes it over when that process is gone instead of
waiting for it forever. `make install` builds every kernel once (python -m deltaserve.kernels.build), so the first
start does not compile; a start that still has to says so ("compiling CPU kernels ... one time, about N s").
Where a kernel cannot be built (no compiler, no ninja, no headers), `load()` returns None, says why once and names
the build log, and the callers keep their portable PyTorch paths; a forward step only asks whether a module is
loaded, never compiles.

Floating point: -ffast-math lets GCC reassociate the scalar tails of the reductions (the vector bodies are written
out by hand); reassociation moves results by float32 rounding only, and the tests' tolerances are derived from that
(tests/tolerance.py). -fno-finite-math-only keeps infinities and NaN meaning what they mean: a NaN in the input
comes out as NaN, not as an arbitrary finite number.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Per instruction set: the native build serves; the AVX2 one (x86-64-v3: AVX2 + FMA, no AVX-512) is what the tests
# also check the kernels with, so their #if __AVX512F__ branches are exercised both ways on one machine.
COMMON_FLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3"]}
BUILD_SECONDS = 60  # about what one kernel takes to compile on 2 cores, for the message
LOCK_POLL_S = 1.0
UNNAMED_LOCK_S = 10.0  # a lock file still without a pid after this long was left by a builder killed mid-write

# What every kernel source starts with: 16 floats as one value (GCC and Clang vector extensions lower it to one
# AVX-512 register, two AVX2 or four SSE registers), and its unaligned load and store.
VECTOR_PRELUDE = r"""
#include <torch/extension.h>
#include <cstdint>
#include <cstring>

typedef float f16v __attribute__((vector_size(64)));
typedef float f16v_u __attribute__((vector_size(64), aligned(4)));
inline f16v load16(const float* p) { return *reinterpret_cast<const f16v_u*>(p); }
inline void store16(float* p, f16v x) { *reinterpret_cast<f16v_u*>(p) = x; }

// Two-input shuffles: Clang spells them __builtin_shufflevector, GCC (any version with vector extensions, 11 on
// Ubuntu 22.04 included) __builtin_shuffle with a mask vector.
typedef int32_t i16v __attribute__((vector_size(64)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i16v{__VA_ARGS__})
#endif

// 16 packed integers widened to 16 int32 lanes. GCC 12 lowers __builtin_convertvector from a 16- or 32-byte vector to
// a 64-byte one as 16 scalar loads and inserts, even with AVX-512 at hand: the packed 4-bit and int8 tiles ran 3-4x
// slower in the AVX-512 build than in the AVX2 one on the same Zen 4 (SmolLM2 decode 44 vs 130 tok/s); x86 takes the
// widening loads (vpmovzxbd / vpmovsxbd / vpmovzxwd) instead.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
typedef uint8_t u8x16_u __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16_u __attribute__((vector_size(16), aligned(1)));
typedef uint16_t u16x16_u __attribute__((vector_size(32), aligned(1)));
#if defined(__AVX512F__)
inline i16v widen_u8(const uint8_t* p) {
  return reinterpret_cast<i16v>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline i16v widen_i8(const int8_t* p) {
  return reinterpret_cast<i16v>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline i16v widen_u16(const uint16_t* p) {
  return reinterpret_cast<i16v>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
// AVX2 builds widen 4-bit and int8 codes in their own __m256 tiles; only the bfloat16 KV load takes widen_u16 there.
inline i16v widen_u8(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const u8x16_u*>(p), i16v);
}
inline i16v widen_i8(const int8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const i8x16_u*>(p), i16v);
}
#if defined(__AVX2__)
inline i16v widen_u16(const uint16_t* p) {  // two 8-lane widening loads
  const __m256i low = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  i16v r;
  std::memcpy(&r, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &high, 32);
  return r;
}
#else
inline i16v widen_u16(const uint16_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const u16x16_u*>(p), i16v);
}
#endif
#endif

// One register of floats at the build's widest vectors: 16 (AVX-512) or 8 (AVX2 and narrower; GCC lowers it to two
// SSE registers where there is no AVX). The GEMM-shaped register tiles (int4_cpu's prefill GEMM, the prefill
// attention) are written on it: 16-float values would take two AVX2 registers each and spill there.
#if defined(__AVX512F__)
constexpr int RW = 16;
#else
constexpr int RW = 8;
#endif
typedef float rvec __attribute__((vector_size(RW * 4)));
typedef float rvec_u __attribute__((vector_size(RW * 4), aligned(4)));
typedef int32_t rvec_i __attribute__((vector_size(RW * 4)));
inline rvec rload(const float* p) { return *reinterpret_cast<const rvec_u*>(p); }
inline void rstore(float* p, rvec x) { *reinterpret_cast<rvec_u*>(p) = x; }
inline rvec rset(float s) { return rvec{} + s; }

// 2^n e^r for |r| <= ln 2 / 2, on any float vector V and its int32 twin I: Cephes' degree-6 polynomial for e^r
// (~1 ulp), its exponent field moved by n. exp16 below and the prefill attention kernel's 2^x (its own width) use it.
template <typename V, typename I>
inline V exp_scaled(V r, I n) {
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  I bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  std::memcpy(&p, &bits, sizeof bits);
  return p;
}

// e^x on 16 floats: 2^n p(r), r = x - n ln 2 (Cody-Waite), p Cephes' degree-6 polynomial (~1 ulp); x is clamped to
// [-87.3, 88.7], the normal range (below, ~1.2e-38 instead of a smaller number or 0). Written out because these
// builds keep -fno-finite-math-only, under which GCC calls the scalar expf for every element of an `omp simd` loop
// instead of glibc's vector one (~15-20 cycles a value).
const i16v LANES16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline f16v exp16(f16v x) {
  const f16v lo = f16v{} - 87.3f, hi = f16v{} + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f16v t = x * 1.44269504088896341f;
  const i16v n = __builtin_convertvector(t + (t < 0.0f ? f16v{} - 0.5f : f16v{} + 0.5f), i16v);  // to nearest
  const f16v nf = __builtin_convertvector(n, f16v);
  f16v r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  return exp_scaled(r, n);
}

// Lane i of the result is the sum of x[i]'s 16 lanes: a transpose-and-add tree, 15 adds for 16 dot products
// where 16 separate horizontal sums would take 64.
inline f16v sum16(const f16v* x) {
  f16v b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = SHUFFLE(x[2 * j], x[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(x[2 * j], x[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    c[j] = SHUFFLE(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    d[j] = SHUFFLE(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#if defined(__AVX2__)
// The sum of v's 8 lanes.
inline float sum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 builds: the tiles use 8-float __m256 values (GCC keeps arrays of 16-float values in memory there and moves
// each through general registers at every step).

// y[m, n] = x[m] . w[n] for MR input rows x [MR, K] and NR float32 weight rows w [NR, K], K a multiple of 8
// (linear_cpu's few-row tile, and int4_cpu's weight rows once widened).
template <int MR, int NR>
inline void f32_tile(const float* __restrict x, const float* __restrict w, int64_t K, float* __restrict y,
                     int64_t ldy) {
  __m256 acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m * NR + n] = _mm256_fmadd_ps(xv, wv[n], acc[m * NR + n]);
    }
  }
  for (int i = 0; i < MR * NR; ++i) y[i / NR * ldy + i % NR] = sum8(acc[i]);
}
#endif
"""


def _bindings(functions: list[str]) -> str:
    """The module's Python bindings, each call made without the GIL: a kernel touches no Python object, and holding
    the GIL through it stalled the server's event loop (it waits for the GIL while the engine thread computes, then
    the engine thread waits for it back: a served stream ran at a fraction of the engine's own speed)."""
    defs = "".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in functions)
    return "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + defs + "}\n"


class CompiledKernels:
    """One C++ extension: its source, the functions it exports, and what it is (for the log line)."""

    def __init__(self, name: str, source: str, functions: list[str], what: str, fallback: str, isa: str = "native"):
        self.name, self.source, self.functions = name, source, functions
        self.what, self.fallback, self.isa = what, fallback, isa
        self.module = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def variant(self, isa: str) -> CompiledKernels:
        """The same kernels built for another instruction set (a module of its own name, so both can be loaded)."""
        return CompiledKernels(f"{self.name}_{isa}", self.source, self.functions, f"{self.what} ({isa})",
                               self.fallback, isa)

    @property
    def flags(self) -> list[str]:
        return ISA_FLAGS[self.isa] + COMMON_FLAGS

    def load(self, log=None):
        """The compiled module (built once per machine into our cache), or None when it cannot be built here."""
        with self._lock:
            if self.module is None and self.error is None:
                try:
                    self.module = _load_or_build(self, log)
                except Exception as e:  # the portable path serves instead
                    self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    if log:
                        log(f"{self.what} unavailable ({self.error}); using {self.fallback}")
            return self.module

    @contextlib.contextmanager
    def disabled(self):
        """Inside the block the module reads as unbuilt, so every caller takes its portable path; the built module
        is kept and back afterwards. For comparisons and for tests of both paths."""
        with self.using(None):
            yield

    @contextlib.contextmanager
    def using(self, module):
        """Inside the block every caller runs `module` (another build of these kernels, or None: portable)."""
        kept, self.module = self.module, module
        try:
            yield
        finally:
            self.module = kept


def cache_root() -> Path:
    """Where built kernels live: $DELTASERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/deltaserve/kernels (~/.cache/...)."""
    given = os.environ.get("DELTASERVE_KERNEL_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltaserve" / "kernels"


def build_key(kernels: CompiledKernels) -> str:
    """A hash of everything the binary depends on: source, flags, compiler (path and version), torch, Python, and
    for a -march=native build the CPU's instruction sets."""
    import torch

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        version = "none"
    parts = [kernels.source + _bindings(kernels.functions), " ".join(kernels.flags), compiler, version,
             torch.__version__, str(Path(torch.__file__).parent), sys.version, ",".join(kernels.functions)]
    if "-march=native" in kernels.flags:
        parts.append(cpu_features())  # a native build from an AVX-512 CPU dies of SIGILL on an AVX2 one (shared home)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def cpu_features() -> str:
    """This CPU's instruction-set flags (Linux /proc/cpuinfo), or its platform name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _load_or_build(kernels: CompiledKernels, log):
    folder = cache_root() / f"{kernels.name}-{build_key(kernels)}"
    library = folder / f"{kernels.name}.so"
    if library.exists():
        return _import(kernels.name, library)
    return _build_once(kernels, folder, log)


def _import(name: str, library: Path):
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_once(kernels: CompiledKernels, folder: Path, log):
    """Build into `folder` unless another live process is doing it (then wait for it and load its build); a dead
    builder's lock and leftovers are taken over."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    library = folder / f"{kernels.name}.so"
    lock = folder.with_name(folder.name + ".lock")
    waited = False
    while not _take_lock(lock):
        if library.exists():
            return _import(kernels.name, library)
        owner = _lock_owner(lock)
        if owner is None and _age_s(lock) > UNNAMED_LOCK_S:  # its creator died before writing its pid in it
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            continue
        if owner is not None and not _alive(owner):
            if log:
                log(f"{kernels.what}: the build by pid {owner[0]} was interrupted; building again")
            if _lock_owner(lock) == owner:  # not already taken over by a third process meanwhile
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
            continue
        if log and not waited:
            who = f"pid {owner[0]}" if owner else "another process"
            log(f"{kernels.what}: waiting for {who}, which is compiling it (lock {lock})")
            waited = True
        time.sleep(LOCK_POLL_S)
    try:
        if library.exists():
            return _import(kernels.name, library)
        return _build(kernels, folder, log)
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def _build(kernels: CompiledKernels, folder: Path, log):
    """Compile in a private scratch folder, then rename it into place whole; the module loaded from the build."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    # torch renames a second build of one name in a process (name_v1, ...); our cache already keys builds, and the
    # library must keep its own name to be found and imported by it
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(kernels.name, None)
    for stale in folder.parent.glob(folder.name + ".tmp-*"):  # left by builders that were killed
        shutil.rmtree(stale, ignore_errors=True)
    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    scratch.mkdir()
    build_log = folder.with_name(folder.name + ".log")
    if log:
        log(f"compiling CPU kernels: {kernels.what} (one time, about {BUILD_SECONDS} s) in {scratch.parent}")
    started = time.monotonic()
    try:
        module = cpp_extension.load_inline(kernels.name, cpp_sources=[kernels.source + _bindings(kernels.functions)],
                             extra_cflags=kernels.flags, extra_ldflags=["-fopenmp"], build_directory=str(scratch),
                             verbose=False, is_python_module=True)
    except Exception as e:  # the compiler's output is in the message: keep it where the error points
        shutil.rmtree(scratch, ignore_errors=True)
        build_log.write_text(f"{type(e).__name__}: {e}\n")
        raise RuntimeError(f"compiling failed; the build log is {build_log}") from None
    try:
        os.replace(scratch, folder)  # whole or not at all: the folder appears with its library in it
    except OSError:  # another builder finished first (a lock taken over twice): its build serves
        shutil.rmtree(scratch, ignore_errors=True)
    if log:
        log(f"compiled {kernels.what} in {time.monotonic() - started:.0f} s")
    return module


def _take_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}\n")
    return True


def _lock_owner(lock: Path) -> tuple[int, str] | None:
    try:
        pid, host = lock.read_text().split()
        return int(pid), host
    except (OSError, ValueError):
        return None  # being written, or already gone: look again


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _alive(owner: tuple[int, str]) -> bool:
    """Whether the lock's process still runs (a lock from another host is trusted: we cannot see its processes)."""
    pid, host = owner
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the venv's bin, which PATH may lack."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
