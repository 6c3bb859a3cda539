"""Batch-1 decode with the native build of the C++ kernels vs their AVX2 build, on this machine, in one process.

The kernels are built with -march=native (AVX-512 where the CPU has it) and the tests also check an AVX2 build
(x86-64-v3). Both must be fast, not only correct: on an AVX-512 CPU the native build should be at least as fast as
the AVX2 one. Until 963ecf0 it was 3x slower on a Zen 4 (GCC had widened every packed code with scalar loads in the
AVX-512 paths only, which the benches, run on AVX2 machines, never showed). This script runs the Engine's batch-1
decode on both builds, alternated, and prints tok/s and native / AVX2; on an AVX2-only CPU the two builds are
nearly the same code and the ratio is ~1.

    OMP_NUM_THREADS=2 python bench/isa.py                 # the built-in SmolLM2 (packed 4-bit, the default path)
    OMP_NUM_THREADS=2 python bench/isa.py --hybrid        # the tiny hybrid (float32 weights)
    OMP_NUM_THREADS=2 python bench/isa.py --int8          # int4_int8_linear alone: AVX2 vs AVX-VNNI vs native build

--int8 times the 4-bit x int8 product (--activation-dtype int8) on SmolLM2's shapes, 1 row and 512, on the AVX2
build (vpmaddubsw), the AVX-VNNI build (x86-64-v3 + 256-bit vpdpbusd: what Alder Lake / Raptor Lake's native build
is; only where this CPU has avx_vnni) and the native one, alternated (--repeats turns of 5 timings a build), and
prints the best times, AVX2 / AVX-VNNI (the VNNI tile's gain over the path those CPUs took before) and AVX2 / native;
the AVX-VNNI build's product is checked equal to the AVX2 build's, bit for bit. On a machine other processes keep
busy, a call longer than a scheduler slice at 2 threads rarely runs without one thread preempted at the barrier, so
its best time overstates the slower builds' 512-row figures: compare with --threads 1 there.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import results
from dense import Ours, prompt

# SmolLM2-135M's projections (out, in): q/o (576 x 576), gate/up (1536 x 576), down (576 x 1536)
INT8_SHAPES = [(576, 576), (1536, 576), (576, 1536)]
INT8_ROWS = [1, 512]


def int8_products(args, run) -> None:
    """int4_int8_linear per shape and row count on each build, alternated; the best time of each."""
    import time

    import torch

    from deltaserve.kernels import int4_int8
    from deltaserve.kernels.cpp_build import cpu_features
    from deltaserve.kernels.int4 import Int4Codes, pack

    torch.set_num_threads(args.threads)
    builds = {"avx2": int4_int8.KERNELS.variant("avx2").load(print)}
    if "avx_vnni" in cpu_features().split():
        builds["avx_vnni"] = int4_int8.KERNELS.variant("avxvnni").load(print)
    else:
        print("this CPU has no AVX-VNNI (avx_vnni): the AVX-VNNI build is left out")
    builds["native"] = int4_int8.KERNELS.load(print)
    if not all(builds.values()):
        raise SystemExit("error: every build is needed (an x86-64 CPU with AVX2 and a C++ compiler)")
    print("builds: " + ", ".join(f"{name} ({module.int4_int8_isa()})" for name, module in builds.items()))
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for n, k in INT8_SHAPES:  # Q4_1-like: groups of 32, float16 scales and offsets
        codes = Int4Codes(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half(),
                          (torch.randn(n, k // 32, generator=gen) * 0.05).half(), 32)
        panel = int4_int8.repack(pack(codes))
        for m in INT8_ROWS:
            x = torch.randn(m, k, generator=gen)

            def call(module):
                return module.int4_int8_linear(x, panel.codes, panel.scales, panel.offsets, 32, int4_int8.EMPTY_LEVELS)

            expect = call(builds["avx2"])
            start = time.perf_counter()
            call(builds["native"])
            # short timings (~2 ms), several a turn: on a shared machine the best of many short ones is the one
            # nobody else's process interrupted
            calls = max(1, int(0.002 / max(time.perf_counter() - start, 1e-6)))
            best = dict.fromkeys(builds, float("inf"))
            for _ in range(args.repeats):
                for name, module in builds.items():
                    call(module)  # warm
                    for _ in range(5):
                        start = time.perf_counter()
                        for _ in range(calls):
                            call(module)
                        best[name] = min(best[name], (time.perf_counter() - start) / calls)
            if "avx_vnni" in builds:
                assert torch.equal(call(builds["avx_vnni"]), expect), "the AVX-VNNI build's product is not AVX2's"
            vnni = best.get("avx_vnni")
            us = {name: t * 1e6 for name, t in best.items()}
            print(f"{n:>5} x {k:<5} {m:>4} rows: AVX2 {us['avx2']:9.1f} us"
                  + (f", AVX-VNNI {us['avx_vnni']:9.1f} us" if vnni else "")
                  + f", native {us['native']:9.1f} us; AVX2 / AVX-VNNI "
                  + (f"{best['avx2'] / vnni:.2f}x" if vnni else "-")
                  + f", AVX2 / native {best['avx2'] / best['native']:.2f}x")
            rows_out.append([f"{n} x {k}", m, results.rounded(us["avx2"]),
                             results.rounded(us["avx_vnni"]) if vnni else None, results.rounded(us["native"]),
                             results.rounded(best["avx2"] / vnni, 2) if vnni else None,
                             results.rounded(best["avx2"] / best["native"], 2)])
    run.table(f"int4_int8_linear (groups of 32, float16 scales and offsets), {args.threads} threads, best of "
              f"{args.repeats} x 5 (alternated)",
              ["weight (out x in)", "rows", "AVX2 us", "AVX-VNNI us", "native us", "AVX2 / AVX-VNNI", "AVX2 / native"],
              rows_out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hybrid", action="store_true", help="the tiny hybrid (bench/hybrid_decode.py's) instead")
    ap.add_argument("--int8", action="store_true",
                    help="int4_int8_linear alone on SmolLM2's shapes: the AVX2, AVX-VNNI and native builds")
    ap.add_argument("--decode", type=int, default=128, help="new tokens per run")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs a side")
    ap.add_argument("--threads", type=int, default=2, help="--int8: threads of the product")
    args = ap.parse_args(argv)
    if args.int8:
        run = results.Run("isa", "int4_int8_linear: the AVX2 build vs the AVX-VNNI build vs the native build", argv)
        int8_products(args, run)
        run.save()
        return 0
    run = results.Run("isa", "Batch-1 decode, the native build of the kernels vs their AVX2 build", argv)

    from deltaserve.kernels import decode_cpu, fused_cpu, int4_cpu, linear_cpu, paged_cpu

    modules = [fused_cpu, int4_cpu, linear_cpu, paged_cpu, decode_cpu]
    native = [m.KERNELS.load(print) for m in modules]
    avx2 = [m.KERNELS.variant("avx2").load(print) for m in modules]
    if not all(native) or not all(avx2):
        raise SystemExit("error: both builds are needed (an x86-64 CPU with AVX2 and a C++ compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.hybrid:
            from hybrid_decode import save_checkpoint

            path = str(save_checkpoint(Path(tmp) / "hybrid"))
        else:
            from deltaserve.budget import default_model_path

            path = str(default_model_path())
        ours = Ours(path, 64, dequantize=False)
        best = {"native": 0.0, "avx2": 0.0}
        for r in range(args.repeats):
            for name, builds in (("native", native), ("avx2", avx2)):
                with contextlib.ExitStack() as stack:
                    for m, module in zip(modules, builds):
                        stack.enter_context(m.KERNELS.using(module))
                    _, seconds = ours._run(prompt(16, r), args.decode)
                best[name] = max(best[name], (args.decode - 1) / seconds)
    what = "tiny hybrid f32" if args.hybrid else "SmolLM2 Q4_1 packed"
    print(f"{what}, batch-1 decode of {args.decode}, best of {args.repeats} (alternated): native "
          f"{best['native']:.1f} tok/s, AVX2 build {best['avx2']:.1f} tok/s: {best['native'] / best['avx2']:.2f}x")
    run.table(f"batch-1 decode of {args.decode}, best of {args.repeats} (alternated)",
              ["model", "native tok/s", "AVX2 build tok/s", "native / AVX2"],
              [[what, results.rounded(best["native"]), results.rounded(best["avx2"]),
                results.rounded(best["native"] / best["avx2"], 2)]])
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
