"""The README's knob table lists exactly the knobs the core declares, with their defaults
and whether every rank must share them."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_lists_every_knob_with_its_default_and_agreement():
    pycomm = pytest.importorskip("pycomm")
    rows = {}
    for line in open(README, encoding="utf-8"):
        m = re.match(r"\| `(PYCOMM_[A-Z_]+)` \| (`([^`]*)`|\(empty\)) \| (same|any) \|", line)
        if m:
            rows[m.group(1)] = (m.group(3) or "", m.group(4) == "same")
    declared = {name: (default, same) for name, default, _, same in pycomm.knobs()}
    assert rows == declared
