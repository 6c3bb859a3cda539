"""The one-time kernel build (kernels/cpp_build.py) survives what a newcomer's first start meets: a build killed while
the compiler runs, a lock left by a dead process, a second environment with other flags, a compiler error."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from deltaserve.kernels import (cpp_build, decode_cpu, fused_cpu, gguf_blocks_cpu, int4_cpu, int4_int8, linear_cpu,
                                paged_cpu, prefill_cpu)
from deltaserve.kernels.cpp_build import CompiledKernels

TINY = "int64_t add_one(int64_t x) { return x + 1; }\n"


def tiny(name: str = "deltaserve_test_tiny", source: str = TINY) -> CompiledKernels:
    return CompiledKernels(name, source, ["add_one"], "test kernel", "nothing")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


BUILD_IN_CHILD = """
import sys
from deltaserve.kernels.cpp_build import CompiledKernels
kernels = CompiledKernels("deltaserve_test_tiny", sys.argv[1], ["add_one"], "test kernel", "nothing")
print("built" if kernels.load(print) is not None else kernels.error, flush=True)
"""


def test_a_build_killed_while_compiling_does_not_wedge_the_next_start(cache):
    child = subprocess.Popen([sys.executable, "-c", BUILD_IN_CHILD, TINY], start_new_session=True,
                             env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
    # until the compiler runs in the child's scratch folder; the child's own end bounds the wait
    while not any(cache.glob("*.tmp-*/build.ninja")) and child.poll() is None:
        time.sleep(0.2)
    assert child.poll() is None, f"the child ended without compiling in {cache}: {child.stdout.read()!r}"
    time.sleep(1.0)
    os.killpg(child.pid, signal.SIGKILL)  # the child, ninja and the compiler: a closed terminal
    child.wait()
    assert list(cache.glob("*.lock")), "the killed builder's lock should be left behind"
    messages: list[str] = []
    module = tiny().load(messages.append)
    assert module is not None and module.add_one(41) == 42
    assert any("interrupted" in m for m in messages), messages
    assert not list(cache.glob("*.lock")) and not list(cache.glob("*.tmp-*"))
    again: list[str] = []
    assert tiny().load(again.append).add_one(1) == 2  # the next start loads the build, compiling nothing
    assert not any("compiling" in m for m in again), again


def test_a_live_builders_lock_is_waited_for_and_its_build_loaded(cache, tmp_path):
    built_cache = tmp_path / "built"
    os.environ["DELTASERVE_KERNEL_CACHE"] = str(built_cache)
    assert tiny().load() is not None  # what the other process is about to finish
    os.environ["DELTASERVE_KERNEL_CACHE"] = str(cache)
    kernels = tiny()
    [built] = [p for p in built_cache.iterdir() if p.is_dir()]
    cache.mkdir(parents=True)
    lock = cache / (built.name + ".lock")
    lock.write_text(f"{os.getppid()} {socket.gethostname()}\n")  # a live process (our parent) holds it

    def other_builder_finishes():
        time.sleep(1.0)
        shutil.copytree(built, cache / "copying")
        os.replace(cache / "copying", cache / built.name)  # a build lands whole, as _build renames it
        lock.unlink()

    threading.Thread(target=other_builder_finishes).start()
    messages: list[str] = []
    assert kernels.load(messages.append).add_one(1) == 2
    assert any("waiting for pid" in m for m in messages), messages
    assert not any("compiling CPU kernels" in m for m in messages), messages


def test_an_empty_lock_left_by_a_builder_killed_mid_write_is_taken_over(cache, tmp_path):
    """A lock file created but never given its pid (the builder died between the two) is stale after a while."""
    built_cache = tmp_path / "built"
    os.environ["DELTASERVE_KERNEL_CACHE"] = str(built_cache)
    assert tiny().load() is not None
    os.environ["DELTASERVE_KERNEL_CACHE"] = str(cache)
    [built] = [p for p in built_cache.iterdir() if p.is_dir()]
    cache.mkdir(parents=True)
    lock = cache / (built.name + ".lock")
    lock.touch()
    old = time.time() - 2 * cpp_build.UNNAMED_LOCK_S
    os.utime(lock, (old, old))
    shutil.copytree(built, cache / built.name)  # the library is there: only the lock stood in the way
    os.remove(cache / built.name / "deltaserve_test_tiny.so")
    assert tiny().load() is not None and not lock.exists()


def test_other_flags_or_sources_build_elsewhere():
    for module in (fused_cpu, linear_cpu):
        native, avx2 = module.KERNELS, module.KERNELS.variant("avx2")
        assert "-march=native" in native.flags and "-march=x86-64-v3" in avx2.flags
        assert cpp_build.build_key(native) != cpp_build.build_key(avx2)
        assert avx2.name != native.name  # a module of its own, so both load in one process
    for module in (int4_int8, decode_cpu):  # the AVX-VNNI build: the AVX2 flags and one more
        avx2, vnni = module.KERNELS.variant("avx2"), module.KERNELS.variant("avxvnni")
        assert "-mavxvnni" in vnni.flags and "-mavxvnni" not in avx2.flags
        assert cpp_build.build_key(vnni) != cpp_build.build_key(avx2) and vnni.name != avx2.name
    assert cpp_build.build_key(tiny()) != cpp_build.build_key(tiny(source=TINY + "// changed\n"))



def test_an_edited_header_rebuilds_every_source_that_includes_it(tmp_path, monkeypatch):
    """The key reads the csrc/ headers a source includes, and theirs: an edit to prelude.h must not load a module
    built from the old one."""
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    (tmp_path / "prelude.h").write_text("#pragma once\n")
    (tmp_path / "tile.h").write_text('#pragma once\n#include "prelude.h"\n')
    source = '#include "tile.h"\n' + TINY
    assert cpp_build.included_headers(source) == [tmp_path / "tile.h", tmp_path / "prelude.h"]
    before = cpp_build.build_key(tiny(source=source))
    (tmp_path / "prelude.h").write_text("#pragma once\n// changed\n")
    assert cpp_build.build_key(tiny(source=source)) != before
    assert cpp_build.build_key(tiny()) == cpp_build.build_key(tiny())  # a source that includes none: unchanged


def test_the_kernel_sources_are_files_that_include_the_prelude():
    """Every module's C++ is a file in csrc/; decode.cpp shares the other modules' pieces through headers, never
    pasted text."""
    for module in (fused_cpu, linear_cpu, decode_cpu, int4_cpu, paged_cpu, prefill_cpu, gguf_blocks_cpu):
        kernels = module.KERNELS
        assert kernels.source_file.parent == cpp_build.CSRC and kernels.source == kernels.source_file.read_text()
        assert cpp_build.CSRC / "prelude.h" in cpp_build.included_headers(kernels.source)
        assert kernels.variant("avx2").source_file == kernels.source_file
    assert {p.name for p in cpp_build.included_headers(decode_cpu.KERNELS.source)} >= {
        "int4_tile.h", "linear_tile.h", "paged_attention.h", "gdn.h"}


def test_a_native_build_is_keyed_by_the_cpu(monkeypatch):
    """-march=native means another binary on another CPU: a home folder shared by an AVX-512 machine and an AVX2 one
    must not hand the AVX2 one a module that dies of SIGILL at import. A fixed-ISA build is the same everywhere."""
    native, avx2 = fused_cpu.KERNELS, fused_cpu.KERNELS.variant("avx2")
    keys = (cpp_build.build_key(native), cpp_build.build_key(avx2))
    monkeypatch.setattr(cpp_build, "cpu_features", lambda: "fpu sse2 avx2 avx512f")
    other = (cpp_build.build_key(native), cpp_build.build_key(avx2))
    assert keys[0] != other[0] and keys[1] == other[1]

def test_a_compiler_error_names_the_log_and_falls_back(cache):
    broken = tiny("deltaserve_test_broken", "int64_t add_one(int64_t x) { return x + ; }\n")
    messages: list[str] = []
    assert broken.load(messages.append) is None
    assert "build log is" in broken.error and any("using nothing" in m for m in messages)
    log = next(cache.glob("deltaserve_test_broken-*.log"))
    assert "error" in log.read_text()
    assert not list(cache.glob("*.lock")) and not list(cache.glob("*.tmp-*"))
