"""The 2B-class Qwen3.5 as a W4A16 compressed-tensors export, the other format our users download: the random model of
bench/make_real_quantized.py (same seed, same shapes), its Linear layers pack-quantized to symmetric 4-bit groups of
--group by compressed-tensors' own compressor (bench/dense.py's save_w4a16: scales from each group's min / max), the
tied embedding / head left in bfloat16 as the library's W4A16 preset leaves lm_head, with SmolLM2's tokenizer.

    python bench/make_real_w4a16.py [--group 128]     # prints the folder; made once, then found in the cache

The folder goes to ~/.cache/deltaserve/real-size/<key>/ (key: this script's and make_real_quantized.py's hashes).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import make_real_quantized  # noqa: E402 - bench/ scripts import each other from their folder


def cache_folder(group: int) -> Path:
    key = hashlib.sha256(HERE.read_bytes() + Path(make_real_quantized.__file__).read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "deltaserve" / "real-size" / key / f"qwen35-2b-w4a16-g{group}"


def make(group: int) -> Path:
    import torch
    from transformers import Qwen3_5ForCausalLM

    from dense import save_w4a16

    out = cache_folder(group)
    if out.exists():
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    source = partial.with_name(partial.name + "-hf")
    make_real_quantized.save_checkpoint(source)
    model = Qwen3_5ForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    partial.mkdir(parents=True)
    save_w4a16(model, partial, group)
    for name in source.iterdir():
        if "token" in name.name or name.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(name, partial / name.name)
    shutil.rmtree(source)
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", type=int, default=128, help="weights per scale (the W4A16 preset's 128)")
    print(make(parser.parse_args().group))


if __name__ == "__main__":
    main()
