"""The generated docs are not stale, the benchmark records are whole, and the README's links lead somewhere.

docs/configuration.md is rebuilt from the argument parsers and docs/benchmarks.md (with the README's speed table)
from bench/results/*.json; each must equal what is committed. Regenerate with `python -m deltaserve.cli_docs` and
`python bench/results.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from deltaserve import cli_docs

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _bench_results():
    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_the_parsers():
    assert (ROOT / "docs" / "configuration.md").read_text() == cli_docs.render(), \
        "docs/configuration.md is stale: run python -m deltaserve.cli_docs"


def test_every_flag_states_its_unit():
    from deltaserve.cli import build_parser

    for name, parser in cli_docs._subparsers(build_parser()).items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                cli_docs._unit(action, name)  # raises MissingUnit naming the flag


def test_benchmarks_page_and_readme_table_are_generated_from_the_records():
    results = _bench_results()
    records = results.load()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == results.render_docs(records), \
        "docs/benchmarks.md is stale: run python bench/results.py"
    readme = (ROOT / "README.md").read_text()
    assert readme == results.with_readme_table(readme, results.readme_table(records)), \
        "the README's speed table is stale: run python bench/results.py"


def test_every_benchmark_record_is_whole():
    results = _bench_results()
    records = results.load()  # raises naming a file that lacks a field
    assert records
    for record in records:
        where = record["_file"]
        assert record["schema"] == results.SCHEMA, where
        assert re.fullmatch(r"\d{4}-\d\d-\d\d(T\d\d:\d\dZ)?", record["date"]), where
        assert (record["source"] == "measured" or record["source"].startswith("transcribed from README at ")
                or record["source"].startswith("assembled from ")), where
        assert record["tables"] or record.get("notes"), f"{where}: no figures"
        for table in record["tables"]:
            assert all(len(row) == len(table["columns"]) for row in table["rows"]), where
    assert any(r.get("readme") for r in records), "no record holds the README's speed table"


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_lead_to_files(page):
    path = ROOT / page
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{page}: the link {target} leads nowhere"


def test_readme_is_for_users():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert "make serve" in text and "make test" in text
    assert not re.search(r"\bsession \d", text, re.IGNORECASE)


def test_a_bench_run_writes_a_whole_record(tmp_path):
    results = _bench_results()
    run = results.Run("example", "an example run", ["--repeats", "1"])
    print("a figure: 1.0 tok/s")
    run.table("tok/s", ["what", "ours", "peer"], [["decode", 1.0, None]])
    path = run.save(tmp_path)
    [record] = results.load(tmp_path)
    assert record["_file"] == path.name and record["source"] == "measured"
    assert "a figure: 1.0 tok/s" in record["output"]
    assert record["command"].endswith("--repeats 1") and record["machine"]["cores"]
    assert "| decode | 1 | - |" in results.render_docs([record])
