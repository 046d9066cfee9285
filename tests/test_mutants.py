"""Every planted bug of `scripts/mutants.py` still applies to the current source.

The sweep itself takes minutes and runs outside `make test`; this check makes a refactor that
moves a snippet (so that its mutant would silently test nothing) fail here instead.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(_spec)
sys.modules["mutants"] = mutants  # dataclasses look their module up there
_spec.loader.exec_module(mutants)


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_to_the_current_source(mutant, tmp_path):
    source = ROOT / mutant.path
    (tmp_path / mutant.path).parent.mkdir(parents=True)
    (tmp_path / mutant.path).write_text(source.read_text())
    mutants.apply(mutant, tmp_path)
    assert (tmp_path / mutant.path).read_text() != source.read_text()
    for test in mutant.tests:
        assert (ROOT / test.split("::")[0]).is_file(), test


def test_mutant_names_are_unique_and_there_are_at_least_nine():
    names = {m.name for m in mutants.MUTANTS}
    assert len(names) == len(mutants.MUTANTS) >= 9
