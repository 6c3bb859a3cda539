"""The differential fuzzer (issue 37): random but valid configurations of every family deltaserve loads (Llama,
Qwen3, Qwen3.5 dense and hybrid, Qwen3-Next, Qwen3.5-MoE), each saved in a format drawn at random (safetensors
float32 / bfloat16, compressed-tensors, GPTQ / AWQ, GGUF) by that format's own tool, served by the real engine with
prompts that cross its chunk, page and checkpoint boundaries (batched, and again through the prefix cache), its KV
cache float32 or 16-bit (the CPU default is float16), packed 4-bit (and int8-held Q8_0) weights on float32 or int8 activations (the CPU
default is int8), and compared with transformers on the format's own dequantization within tests/tolerance.py's
float32 bound (a 16-bit KV cache's rounding shared by the oracle, kv_oracle.py) plus the int8 activations' rounding
(tests/int8_bound.py). What a case draws is checked to have happened (a prefix-cache hit's depth, fixed drafts
drafted), and mutants.py's planted bugs must each fail the fixed slice (test_mutants.py).
One seed in ten also carries a Qwen3.5 multimodal case (vision and text configs, pixel range and images drawn), an
image file through our preprocessing and model against transformers' processor and model
(tests/vision_support.ImageOracle).

    draw.py      a seed -> a Case (config, format, engine settings, requests); valid by construction
    formats.py   the Case's checkpoint written by the format's own tool, and the oracle model
    run.py       the engine against the oracle: a Result listing each difference (`--explain`: each bound's parts)
    kv_oracle.py the oracle of a 16-bit KV cache (K and V rounded where the engine rounds them) and its bounds
    mutants.py   planted one-line bugs, and test_mutants.py the self-test that each fails the fixed slice
    test_fuzz.py the fixed-seed slice `make test` runs
    __main__.py  long runs and replays: `.venv/bin/python -m tests.fuzz --seed 1234`, `make fuzz N=500`
"""
