"""Building the small C++ CPU kernels: torch's cpp_extension (ninja + the system C++ compiler), once per machine.

A build is cached by torch under its extension directory, so only the first start on a machine pays the compile
(~1 min each). Where it cannot be built (no compiler, no ninja, no headers), `load()` returns None, says why once,
and the callers keep their portable PyTorch paths; a forward step only ever asks `ready()`, never compiles.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading

FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

# What every kernel source starts with: 16 floats as one value (GCC and Clang vector extensions lower it to one
# AVX-512 register, two AVX2 or four SSE registers), and its unaligned load and store.
VECTOR_PRELUDE = r"""
#include <torch/extension.h>
#include <cstdint>

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
"""


class CompiledKernels:
    """One C++ extension: its source, the functions it exports, and what it is (for the log line)."""

    def __init__(self, name: str, source: str, functions: list[str], what: str, fallback: str):
        self.name, self.source, self.functions = name, source, functions
        self.what, self.fallback = what, fallback
        self.module = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load(self, log=None):
        """The compiled module (built once per machine, cached by torch), or None when it cannot be built here."""
        with self._lock:
            if self.module is None and self.error is None:
                try:
                    from torch.utils.cpp_extension import load_inline

                    _ninja_on_path()
                    self.module = load_inline(self.name, cpp_sources=[self.source], functions=self.functions,
                                              extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
                except Exception as e:  # the portable path serves instead
                    self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    if log:
                        log(f"{self.what} unavailable ({self.error}); using {self.fallback}")
            return self.module

    @contextlib.contextmanager
    def disabled(self):
        """Inside the block the module reads as unbuilt, so every caller takes its portable path; the built module
        is kept and back afterwards. For comparisons and for tests of both paths."""
        module, self.module = self.module, None
        try:
            yield
        finally:
            self.module = module


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the venv's bin, which PATH may lack."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
