"""Batch-1 decode with the native build of the C++ kernels vs their AVX2 build, on this machine, in one process.

The kernels are built with -march=native (AVX-512 where the CPU has it) and the tests also check an AVX2 build
(x86-64-v3). Both must be fast, not only correct: on an AVX-512 CPU the native build should be at least as fast as
the AVX2 one. Until 963ecf0 it was 3x slower on a Zen 4 (GCC had widened every packed code with scalar loads in the
AVX-512 paths only, which the benches, run on AVX2 machines, never showed). This script runs the Engine's batch-1
decode on both builds, alternated, and prints tok/s and native / AVX2; on an AVX2-only CPU the two builds are
nearly the same code and the ratio is ~1.

    OMP_NUM_THREADS=2 python bench/isa.py                 # the built-in SmolLM2 (packed 4-bit, the default path)
    OMP_NUM_THREADS=2 python bench/isa.py --hybrid        # the tiny hybrid (float32 weights)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import results
from dense import Ours, prompt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hybrid", action="store_true", help="the tiny hybrid (bench/hybrid_decode.py's) instead")
    ap.add_argument("--decode", type=int, default=128, help="new tokens per run")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs a side")
    args = ap.parse_args(argv)
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
