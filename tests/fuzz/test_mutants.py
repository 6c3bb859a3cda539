"""The mutation self-test (issue 54): every planted bug of mutants.py fails a case of the fixed slice. A mutant that
passes the whole slice fails this test, naming it: the proof has a hole there."""

from __future__ import annotations

import pytest

from .mutants import MUTANTS
from .run import run_seed
from .test_fuzz import REGRESSIONS, SLICE


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_slice_catches_the_planted_bug(mutant):
    seeds = list(dict.fromkeys([*mutant.first_seeds, *SLICE, *REGRESSIONS]))
    with mutant.plant():
        for seed in seeds:
            result = run_seed(seed)
            if not result.ok:
                print(f"{mutant.name}: caught by seed {seed}: {result.failures[0]}")
                return
    pytest.fail(f"planted bug {mutant.fault!r} passed every case of the slice ({len(seeds)} seeds)")
