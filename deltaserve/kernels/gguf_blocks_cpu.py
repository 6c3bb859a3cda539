"""GGUF blocks unpacked at load by a small C++ kernel: Q4_K and IQ4_XS into the packed 4-bit layout (kernels/int4.py),
Q6_K and Q5_K into 8-bit codes (kernels/int8.py's Int8Rows), one pass over the file's bytes on every core.

The numpy forms in weights/gguf_int4.py and gguf_int8.py make several passes over each tensor (a mask, a shift, an
or, each over all of it): a 2B Q4_K_M's 248K-row Q6_K embedding alone took ~4 s of its ~10 s load, a 27B file
minutes. Each function here returns exactly what its numpy twin returns (tests/test_weights_gguf_blocks.py compares
them bit for bit); where the module cannot be built, the loader keeps the numpy path.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

KERNELS = CompiledKernels("deltaserve_gguf_blocks", CSRC / "gguf_blocks.cpp",
                           ["q4_k_packed", "iq4_xs_packed", "q6_k_codes", "q5_k_codes"],
                           "GGUF block unpacking kernels", "the numpy block readers")
BLOCK_BYTES = {"q4_k_packed": 144, "iq4_xs_packed": 136, "q6_k_codes": 210, "q5_k_codes": 176}


def load(log=None):
    """The compiled module (built once per machine into our kernel cache), or None when it cannot be built here."""
    return KERNELS.load(log)


def disabled():
    """Inside the block the loader takes the numpy readers (the built module is kept); for comparisons."""
    return KERNELS.disabled()


def unpack(function: str, data: np.ndarray) -> list[torch.Tensor] | None:
    """`function`'s outputs for the blocks in `data` (a tensor's bytes, e.g. a view of the mapped file: read in
    place, not copied), None when the module is not loaded."""
    if KERNELS.module is None:
        return None
    with warnings.catch_warnings():  # a read-only map of the file: the kernel only reads it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1, BLOCK_BYTES[function]))
    return getattr(KERNELS.module, function)(blocks)
