"""EngineConfig: sizes, flags, device defaults and one clear error per bad setting."""

import argparse

import pytest

from deltaserve.config import ConfigError, EngineConfig, add_engine_arguments, parse_bytes


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return EngineConfig.from_args(parser.parse_args(argv))


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("8G", 8 * 2**30),
    ("4096", 4096), ("1.5 GiB", 3 * 2**29), ("100kb", 100_000), ("2KiB", 2048), (".5GiB", 2**29),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "--1GiB", "1..5G"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError, match="cannot read"):
        parse_bytes(text)


def test_flags_reach_the_config():
    c = parse(["--mem-fraction", "0.91", "--headroom", "1.5GiB", "--max-total-tokens", "133120",
               "--context-length", "133120", "--max-running-requests", "3", "--prefill-chunk-tokens", "1024",
               "--kv-dtype", "fp8", "--state-dtype", "bf16", "--max-new-tokens-cap", "16384",
               "--default-max-tokens", "4096", "--page-size", "32", "--device", "cpu", "--model", "m.gguf"])
    assert (c.mem_fraction, c.headroom, c.max_total_tokens, c.context_length) == (0.91, 3 * 2**29, 133120, 133120)
    assert (c.max_running_requests, c.prefill_chunk_tokens, c.page_size) == (3, 1024, 32)
    assert (c.kv_dtype, c.state_dtype) == ("float8_e4m3fn", "bfloat16")
    assert (c.max_new_tokens_cap, c.default_max_tokens, c.device, c.model) == (16384, 4096, "cpu", "m.gguf")


def test_device_size_plans_for_a_gpu():
    c = parse(["--device", "24GiB"])
    assert (c.device, c.device_memory, c.device_kind()) == ("cuda", 24 * 2**30, "cuda")


def test_device_defaults():
    cpu = EngineConfig().for_device("cpu")
    gpu = EngineConfig().for_device("cuda")
    assert (cpu.dtype, cpu.kv_dtype, cpu.state_dtype, cpu.headroom, cpu.mem_fraction) == (
        "float32", "float16", "float32", 0, 0.5)  # float16 KV storage under float32 arithmetic on CPU
    assert (gpu.dtype, gpu.kv_dtype, gpu.state_dtype, gpu.headroom, gpu.mem_fraction) == (
        "bfloat16", "bfloat16", "bfloat16", 512 * 2**20, 0.9)
    assert (cpu.attention_backend, gpu.attention_backend) == ("paged", "paged")
    assert (cpu.dequantize_weights, gpu.dequantize_weights) == (False, False)  # 4-bit matrices packed
    assert EngineConfig(dequantize_weights=True).for_device("cpu").dequantize_weights
    explicit = EngineConfig(mem_fraction=0.8, headroom=0, kv_dtype="bf16").for_device("cuda")
    assert (explicit.mem_fraction, explicit.headroom, explicit.kv_dtype) == (0.8, 0, "bfloat16")
    assert EngineConfig(kv_dtype="float32").for_device("cpu").kv_dtype == "float32"
    assert EngineConfig(dtype="bfloat16").for_device("cpu").kv_dtype == "bfloat16"


@pytest.mark.parametrize("argv, words", [
    (["--mem-fraction", "1.2"], ["--mem-fraction 1.2", "(0, 1]"]),
    (["--mem-fraction", "0"], ["--mem-fraction 0", "(0, 1]"]),
    (["--headroom=-5"], ["--headroom -5", ">= 0"]),
    (["--headroom", "lots"], ["--headroom", "cannot read 'lots'"]),
    (["--context-length", "8192", "--max-new-tokens-cap", "16384"], ["--max-new-tokens-cap 16384", "8192"]),
    (["--max-total-tokens", "0"], ["--max-total-tokens 0", "positive"]),
    (["--max-total-tokens", "15"], ["--max-total-tokens 15", "--page-size 16"]),
    (["--header-timeout-s", "0"], ["--header-timeout-s 0", "positive"]),
    (["--shutdown-timeout=-1"], ["--shutdown-timeout -1", ">= 0"]),
    (["--api-key", "k", "--api-key-file", "f"], ["--api-key", "--api-key-file"]),
    (["--page-size", "-16"], ["--page-size -16", "positive"]),
    (["--max-running-requests", "0"], ["--max-running-requests 0", "positive"]),
    (["--default-max-tokens", "32000"], ["--default-max-tokens 32000", "16384"]),
    (["--kv-dtype", "int3"], ["--kv-dtype 'int3'", "float32"]),
    (["--prefill-dtype", "fp8"], ["--prefill-dtype 'fp8'", "float32, bfloat16"]),
    (["--device", "tpu"], ["--device 'tpu'", "24GiB"]),
])
def test_bad_settings_name_the_setting_and_limit(argv, words):
    with pytest.raises(ConfigError) as err:
        parse(argv)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_frozen_and_validated_on_replace():
    import dataclasses

    c = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 32
    with pytest.raises(ConfigError):
        dataclasses.replace(c, mem_fraction=2.0)


def test_api_key_redacted_in_dict():
    assert EngineConfig(api_key="secret").to_dict()["api_key"] == "***"


def test_api_key_from_a_file_or_the_environment_not_only_the_command_line(tmp_path, monkeypatch):
    monkeypatch.delenv("DELTASERVE_API_KEY", raising=False)
    assert parse([]).api_key is None
    monkeypatch.setenv("DELTASERVE_API_KEY", "from-env")
    assert parse([]).api_key == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")
    assert parse(["--api-key-file", str(key_file)]).api_key == "from-file"  # a file beats the environment
    assert parse(["--api-key", "given"]).api_key == "given"
    assert parse(["--api-key", "given"]).to_dict()["api_key"] == "***"
    with pytest.raises(ConfigError, match="--api-key-file .*cannot read"):
        parse(["--api-key-file", str(tmp_path / "missing")])
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="first line is empty"):
        parse(["--api-key-file", str(key_file)])


def test_access_lists_are_comma_separated():
    c = parse(["--allowed-hosts", "a.lan, b.lan", "--allowed-origins", "http://x:3000"])
    assert (c.allowed_hosts, c.allowed_origins) == (("a.lan", "b.lan"), ("http://x:3000",))
