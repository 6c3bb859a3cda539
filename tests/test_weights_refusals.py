"""Bad quantized checkpoints are refused by the CLI in one line that names what is wrong, exit code 2: an unknown
scheme (FP8, 2-bit, another quant_method), an unconsumed tensor, a scale of the wrong shape, a truncated shard;
in compressed-tensors checkpoints and in the GPTQ / AWQ layouts AutoRound exports."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.cli import main
from tests.test_weights_compressed_tensors import make_checkpoint

MODULE = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    make_checkpoint("dense_w4_g32_int8embed_int4head", folder)
    return folder


def copy_with(good, tmp_path, *, config=None, tensors=None):
    """A copy of the good checkpoint with its config and / or tensors edited."""
    for f in good.iterdir():
        shutil.copy(f, tmp_path / f.name)
    if config:
        data = json.loads((tmp_path / "config.json").read_text())
        config(data["quantization_config"])
        (tmp_path / "config.json").write_text(json.dumps(data))
    if tensors:
        state = load_file(tmp_path / "model.safetensors")
        tensors(state)
        save_file(state, tmp_path / "model.safetensors")
    return tmp_path


def refused(folder, capsys) -> str:
    assert main(["generate", "--model", str(folder), "--max-tokens", "1", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]  # generate prints the ledger first; the refusal is one line after it
    assert last.startswith("deltaserve generate: error: "), err
    return last


def body(qc):
    """The config group of the 4-bit linears (the library names groups group_0, group_1, ...)."""
    return next(g for g in qc["config_groups"].values() if "Linear" in g["targets"])


def weights_of(qc):
    return body(qc)["weights"]


BAD_CONFIGS = {
    "fp8": (lambda qc: weights_of(qc).update(type="float", num_bits=8), "type 'float'"),
    "2-bit": (lambda qc: weights_of(qc).update(num_bits=2), "2-bit weights; supported: 4, 8"),
    "w4a8": (lambda qc: body(qc).update(input_activations={"num_bits": 8, "type": "int"}),
             "quantizes activations"),
    "hqq": (lambda qc: qc.update(quant_method="hqq"), "quant_method 'hqq' is not supported"),
    "format": (lambda qc: body(qc).update(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
}


@pytest.mark.parametrize("bad", list(BAD_CONFIGS))
def test_unknown_scheme_refused(good, tmp_path, capsys, bad):
    edit, says = BAD_CONFIGS[bad]
    assert says in refused(copy_with(good, tmp_path, config=edit), capsys)


def test_unconsumed_tensors_refused(good, tmp_path, capsys):
    folder = copy_with(good, tmp_path, tensors=lambda s: s.update({f"{MODULE}.input_scale": torch.ones(1)}))
    assert f"{MODULE}.input_scale is not consumed" in refused(folder, capsys)
    folder = copy_with(good, tmp_path, tensors=lambda s: s.update({"model.extra.weight": torch.ones(2)}))
    assert "unknown tensors, e.g. model.extra.weight" in refused(folder, capsys)


def test_scale_of_wrong_shape_refused(good, tmp_path, capsys):
    def halve(state):
        state[f"{MODULE}.weight_scale"] = state[f"{MODULE}.weight_scale"][:, :2].contiguous()

    err = refused(copy_with(good, tmp_path, tensors=halve), capsys)
    assert f"{MODULE}.weight_scale has shape (128, 2), expected (128, 4)" in err


def test_quantized_module_without_a_group_refused(good, tmp_path, capsys):
    err = refused(copy_with(good, tmp_path, config=lambda qc: qc["ignore"].append(MODULE)), capsys)
    assert f"module {MODULE} is in quantization_config.ignore" in err


def test_truncated_shard_refused(good, tmp_path, capsys):
    folder = copy_with(good, tmp_path)
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    assert "truncated safetensors file" in refused(folder, capsys)


@pytest.fixture(scope="module", params=["auto_round:auto_gptq", "awq"])
def good_gptq(request, tmp_path_factory):
    """A tiny Qwen3 packed by AutoRound's own packers (tests/test_weights_gptq.py)."""
    pytest.importorskip("auto_round_extension")
    from tests.test_weights_gptq import make_tiny_qwen3

    folder = tmp_path_factory.mktemp(request.param.replace(":", "_"))
    make_tiny_qwen3(request.param, folder)
    return folder, "AWQ" if request.param == "awq" else "GPTQ"


def test_gptq_layout_bits_other_than_4_refused(good_gptq, tmp_path, capsys):
    good, kind = good_gptq
    err = refused(copy_with(good, tmp_path, config=lambda qc: qc.update(bits=2)), capsys)
    assert re.search(rf"model\.layers\.\d\.\S+ has 2-bit {kind}-layout weights; supported: 4$", err), err
    # AutoRound's per-module override (extra_config): the module it names
    down = "model.layers.1.mlp.down_proj"
    err = refused(copy_with(good, tmp_path, config=lambda qc: qc.update(extra_config={down: {"bits": 8}})), capsys)
    assert f"{down} has 8-bit {kind}-layout weights" in err


def test_gptq_layout_scale_of_wrong_shape_refused(good_gptq, tmp_path, capsys):
    good, _ = good_gptq

    def narrow(state):
        state[f"{MODULE}.scales"] = state[f"{MODULE}.scales"][:, :-8].contiguous()

    assert f"tensor {MODULE}.scales has shape" in refused(copy_with(good, tmp_path, tensors=narrow), capsys)


def test_gptq_layout_unconsumed_tensor_refused(good_gptq, tmp_path, capsys):
    good, _ = good_gptq

    def stray(state):  # the zero points of a module that has no codes
        state["model.layers.0.mlp.extra.qzeros"] = state[f"{MODULE}.qzeros"].clone()

    err = refused(copy_with(good, tmp_path, tensors=stray), capsys)
    assert "tensor model.layers.0.mlp.extra.qzeros is not consumed" in err


def test_awq_other_version_refused_by_the_cli(good_gptq, tmp_path, capsys):
    good, kind = good_gptq
    if kind != "AWQ":
        pytest.skip("AWQ's version field")
    err = refused(copy_with(good, tmp_path, config=lambda qc: qc.update(version="gemv")), capsys)
    assert "AWQ version 'gemv' is not supported; supported: gemm" in err
