"""Loading a quantized checkpoint holds no second copy of it: a compressed-tensors W4 checkpoint (packed by the
library's own pack_to_int32) loaded packed, the CPU default, in a fresh process.

What is measured: the process's anonymous resident memory (RSS less file-backed pages: the safetensors file is
memory-mapped, and its page-cache pages are the file's, not a copy) sampled every millisecond during a second load
(the first pays for imports), under MALLOC_MMAP_THRESHOLD_=65536 so that every freed temporary returns to the OS at
once: the peak is then what the loader holds live. Reading every raw part before decoding, then every module's
one-byte codes before packing, peaked at 2.7x the weights (this test at b35ef58, 2026-12-04: 72 MiB for 26.6 MiB
held); decoding and packing each module as its last part arrives leaves the raw parts of one module and its
temporaries on top of what is held (1.07x: 28.6 MiB).
Sampling can miss a peak, never invent one, so the bound cannot fail spuriously."""

import json
import os
import subprocess
import sys

import pytest
import torch

ct = pytest.importorskip("compressed_tensors")
psutil = pytest.importorskip("psutil")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402

PROBE = r"""
import gc, json, sys, threading, time, psutil
from deltaserve.engine.loader import load_model
proc = psutil.Process()
def anon():
    m = proc.memory_info()
    return m.rss - m.shared
load_model(sys.argv[1], dequantize=False)
gc.collect()
base, top, stop = anon(), [0], []
def sample():
    while not stop:
        top[0] = max(top[0], anon())
        time.sleep(0.001)
thread = threading.Thread(target=sample)
thread.start()
model = load_model(sys.argv[1], dequantize=False).model
stop.append(1)
thread.join()
held = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
print(json.dumps({"held": held, "peak": top[0] - base}))
"""


@pytest.fixture(scope="module")
def w4_checkpoint(tmp_path_factory):
    """A Qwen3 of 4 layers (hidden 1024, MLP 2816, 34M weights) in compressed-tensors W4A16 group 128."""
    import transformers
    from safetensors.torch import save_file

    from tests.test_models_hybrid import VOCAB, save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("w4_load_memory")
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in transformers.Qwen3ForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("proj.weight"):
            n, k = shape
            module = name[: -len(".weight")]
            values = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
            state[module + ".weight_packed"] = pack_to_int32(values, 4)
            state[module + ".weight_scale"] = (torch.rand(n, k // 128, generator=g) * 0.01).to(torch.bfloat16)
            state[module + ".weight_shape"] = torch.tensor([n, k])
        else:
            state[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
    (folder / "config.json").write_text(json.dumps(data))
    save_file(state, folder / "model.safetensors")
    save_tiny_tokenizer(folder)
    return folder


def test_packed_load_peaks_near_what_it_holds(w4_checkpoint):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE, str(w4_checkpoint)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["held"] > 15 * 2**20  # the 4-bit matrices, packed
    # one module's raw parts and temporaries (the largest: 2816 x 1024 weights, ~9 bytes each) on top of what
    # is held, with room for Python's own: a second copy of the model would be +100%
    assert result["peak"] <= 1.5 * result["held"], result
