"""`python -m deltaserve.kernels.build`: compile every CPU kernel once (what `make install` runs), so that the first
start of the server does not. A kernel that cannot be built here is reported and skipped: the engine then uses the
portable PyTorch path and says so; this command still exits 0, since serving works without it."""

from __future__ import annotations

import sys

from deltaserve.kernels import (decode_cpu, fused_cpu, gguf_blocks_cpu, int4_cpu, int4_int8, linear_cpu, paged_cpu,
                                prefill_cpu)

MODULES = (fused_cpu, linear_cpu, paged_cpu, prefill_cpu, int4_cpu, decode_cpu, int4_int8, gguf_blocks_cpu)


def main() -> int:
    def log(message: str) -> None:
        print(f"deltaserve kernels: {message}", file=sys.stderr, flush=True)

    built = [m.load(log) is not None for m in MODULES]
    log(f"{sum(built)} of {len(built)} CPU kernel modules ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
