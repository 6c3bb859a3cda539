"""deltaserve stress: matrix and argument parsing, and the CLI's one-line errors for bad input."""

import argparse
import socket
import subprocess
import sys

import pytest

from deltaserve.stress.cli import add_arguments, cells_from_args
from deltaserve.stress.client import TargetError, parse_target_url
from deltaserve.stress.matrix import (FIELD_CASES, MAX_CELLS, MatrixError, build_matrix, field_preset, parse_count,
                                      parse_count_list)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_count_lists_parse_in_order_with_k_suffix_and_without_duplicates():
    assert parse_count_list("1,3,8", "--concurrency") == [1, 3, 8]
    assert parse_count_list(" 14k, 1000 ,14000,", "--prompt-tokens") == [14000, 1000]
    assert parse_count("15_181", "--gen-tokens") == 15181


@pytest.mark.parametrize("text, needle", [
    ("", "empty list"), (" , ,", "empty list"), ("1,a", "'a' is not a whole number"), ("2.5", "'2.5'"),
    ("0", "out of range"), ("-3", "out of range"), ("99999999", "out of range"),
])
def test_bad_count_lists_name_the_option_and_the_problem(text, needle):
    with pytest.raises(MatrixError) as e:
        parse_count_list(text, "--concurrency")
    assert "--concurrency" in str(e.value) and needle in str(e.value)


def test_matrix_is_the_full_cross_product_with_rounds():
    cells = build_matrix([1, 2], [64, 256], [8, 16, 32], rounds=3)
    assert len(cells) == 12
    assert {(c.concurrency, c.prompt_tokens, c.gen_tokens) for c in cells} == {
        (c, p, g) for c in (1, 2) for p in (64, 256) for g in (8, 16, 32)}
    assert all(c.requests == 3 * c.concurrency for c in cells)
    assert len({c.label for c in cells}) == 12


def test_matrix_refuses_empty_lists_zero_rounds_and_huge_sizes():
    with pytest.raises(MatrixError, match="--prompt-tokens: empty"):
        build_matrix([1], [], [8], rounds=1)
    with pytest.raises(MatrixError, match="--rounds"):
        build_matrix([1], [8], [8], rounds=0)
    side = int(MAX_CELLS ** 0.5) + 1
    with pytest.raises(MatrixError, match="cells"):
        build_matrix(list(range(1, side + 1)), list(range(1, side + 1)), [8], rounds=1)


def test_field_preset_holds_the_field_notes_cases_scaled():
    full = field_preset(1.0, rounds=1)
    assert [(c.concurrency, c.prompt_tokens, c.gen_tokens) for c in full] == [
        (case.concurrency, case.prompt_tokens, case.gen_tokens) for case in FIELD_CASES]
    assert {(3, 14000)} <= {(c.concurrency, c.prompt_tokens) for c in full}
    assert sorted(c.prompt_tokens for c in full if c.concurrency == 1) == [12000, 22000, 36000, 72000]
    assert max(c.gen_tokens for c in full) == 15181 and field_preset(1e-4, rounds=1)[0].gen_tokens == 8
    small = field_preset(0.01, rounds=2)
    assert [c.prompt_tokens for c in small] == [round(c.prompt_tokens * 0.01) for c in full]
    assert [c.gen_tokens for c in small] == [max(8, round(c.gen_tokens * 0.01)) for c in full]
    assert [c.requests for c in small] == [2 * c.concurrency for c in full]
    for bad in (0.0, -1.0, float("nan"), 1e6):
        with pytest.raises(MatrixError, match="--scale"):
            field_preset(bad, rounds=1)


def test_cells_from_args_uses_defaults_preset_or_lists_but_not_both():
    assert len(cells_from_args(parse())) >= 1
    assert len(cells_from_args(parse("--concurrency", "1,2", "--prompt-tokens", "64", "--gen-tokens", "8,16"))) == 4
    assert len(cells_from_args(parse("--preset", "field", "--scale", "0.01"))) == len(FIELD_CASES)
    with pytest.raises(MatrixError, match="not both"):
        cells_from_args(parse("--preset", "field", "--gen-tokens", "8"))


def test_target_url_accepts_base_or_v1_and_refuses_other_hosts():
    assert parse_target_url("http://127.0.0.1:8000", False) == ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1")
    assert parse_target_url("http://localhost:9/v1/", False) == ("http://localhost:9", "http://localhost:9/v1")
    assert parse_target_url("http://[::1]:9", False)[1] == "http://[::1]:9/v1"
    with pytest.raises(TargetError, match="--allow-remote"):
        parse_target_url("http://10.1.2.3:8000", False)
    assert parse_target_url("http://10.1.2.3:8000", True)[0] == "http://10.1.2.3:8000"
    with pytest.raises(TargetError, match="not an http"):
        parse_target_url("127.0.0.1:8000", False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, needle", [
    (["--concurrency", ""], "--concurrency: empty list"),
    (["--prompt-tokens", "1000,lots"], "'lots' is not a whole number"),
    (["--gen-tokens", "0"], "--gen-tokens: 0 is out of range"),
    (["--duration-limit", "inf"], "--duration-limit"),
    (["--url", "http://192.0.2.1:8000"], "--allow-remote"),
    ([], "cannot reach"),
])
def test_cli_bad_arguments_give_one_line_and_exit_2(argv, needle, tmp_path):
    url = ["--url", f"http://127.0.0.1:{free_port()}"]
    proc = subprocess.run([sys.executable, "-m", "deltaserve.stress", *url, *argv, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not any(tmp_path.iterdir())
