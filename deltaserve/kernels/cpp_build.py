"""Building the small C++ CPU kernels: torch's cpp_extension (ninja + the system C++ compiler), once per machine.

The sources are files: kernels/csrc/<module>.cpp, and the headers they share (prelude.h, and the pieces decode.cpp
compiles beside their own module's: int4_tile.h, linear_tile.h, paged_attention.h, gdn.h), with csrc/ on the include
path. Each build lands in its own folder of our cache (~/.cache/deltaserve/kernels, or $DELTASERVE_KERNEL_CACHE),
named by a hash of everything that shapes the binary: the source and every csrc/ header it includes (so an edit to
prelude.h rebuilds every module), the flags, the compiler and its version, torch, Python and the folder torch is
installed in. Two virtual environments, two compilers or an AVX2 build beside the native one therefore never build
over each other. A build runs in a private temporary folder and is renamed into place whole,
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
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Per instruction set: the native build serves; the AVX2 one (x86-64-v3: AVX2 + FMA, no AVX-512) is what the tests
# also check the kernels with, so their #if __AVX512F__ branches are exercised both ways on one machine. The
# AVX-VNNI one (x86-64-v3 plus 256-bit VEX vpdpbusd, what -march=native gives on Alder Lake / Raptor Lake) checks
# int4_int8's #if __AVXVNNI__ tile on a CPU that has AVX-512 as well.
COMMON_FLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3"], "avxvnni": ["-march=x86-64-v3", "-mavxvnni"]}
BUILD_SECONDS = 60  # about what one kernel takes to compile on 2 cores, for the message
LOCK_POLL_S = 1.0
UNNAMED_LOCK_S = 10.0  # a lock file still without a pid after this long was left by a builder killed mid-write

# The kernels' C++: one .cpp per module and the headers they share (prelude.h: the vector types and helpers every
# source starts with). Sources are compiled with this folder on the include path.
CSRC = Path(__file__).parent / "csrc"
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _bindings(functions: list[str]) -> str:
    """The module's Python bindings, each call made without the GIL: a kernel touches no Python object, and holding
    the GIL through it stalled the server's event loop (it waits for the GIL while the engine thread computes, then
    the engine thread waits for it back: a served stream ran at a fraction of the engine's own speed)."""
    defs = "".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in functions)
    return "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + defs + "}\n"


class CompiledKernels:
    """One C++ extension: its source (a file in csrc/, or C++ text), the functions it exports, and what it is (for
    the log line)."""

    def __init__(self, name: str, source: str | Path, functions: list[str], what: str, fallback: str,
                 isa: str = "native"):
        self.name, self.functions = name, functions
        self.source_file = Path(source) if isinstance(source, Path) else None
        self.source = source.read_text() if isinstance(source, Path) else source
        self.what, self.fallback, self.isa = what, fallback, isa
        self.module = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def variant(self, isa: str) -> CompiledKernels:
        """The same kernels built for another instruction set (a module of its own name, so both can be loaded)."""
        return CompiledKernels(f"{self.name}_{isa}", self.source_file or self.source, self.functions,
                               f"{self.what} ({isa})", self.fallback, isa)

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
    """A hash of everything the binary depends on: source, the headers it includes from csrc/ (theirs too), flags,
    compiler (path and version), torch, Python, and for a -march=native build the CPU's instruction sets."""
    import torch

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        version = "none"
    headers = [f"{path.name}\n{path.read_text()}" for path in included_headers(kernels.source)]
    parts = [kernels.source + _bindings(kernels.functions), *headers, " ".join(kernels.flags), compiler, version,
             torch.__version__, str(Path(torch.__file__).parent), sys.version, ",".join(kernels.functions)]
    if "-march=native" in kernels.flags:
        parts.append(cpu_features())  # a native build from an AVX-512 CPU dies of SIGILL on an AVX2 one (shared home)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def included_headers(source: str) -> list[Path]:
    """The csrc/ headers a source includes ("name.h"), and the ones they include, each once, in the order met."""
    found: list[Path] = []
    pending = [source]
    while pending:
        for name in _INCLUDE.findall(pending.pop(0)):
            path = CSRC / name
            if path.is_file() and path not in found:
                found.append(path)
                pending.append(path.read_text())
    return found


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
        module = cpp_extension.load_inline(kernels.name, cpp_sources=[_translation_unit(kernels)],
                                           extra_cflags=kernels.flags, extra_ldflags=["-fopenmp"],
                                           extra_include_paths=[str(CSRC)], build_directory=str(scratch),
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


def _translation_unit(kernels: CompiledKernels) -> str:
    """What the compiler reads: the source, then the bindings; a #line names the file in csrc/, so the compiler's
    messages point at it rather than at torch's copy in the scratch folder."""
    where = f'#line 1 "{kernels.source_file}"\n' if kernels.source_file else ""
    return where + kernels.source + _bindings(kernels.functions)


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
