"""Building the small C++ CPU kernels: torch's cpp_extension (ninja + the system C++ compiler), once per machine.

A build is cached by torch under its extension directory, so only the first start on a machine pays the compile
(~1 min each). Where it cannot be built (no compiler, no ninja, no headers), `load()` returns None, says why once,
and the callers keep their portable PyTorch paths; a forward step only ever asks `ready()`, never compiles.
"""

from __future__ import annotations

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


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the venv's bin, which PATH may lack."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
