"""The suite's property tests draw the same examples on every run unless asked to explore (tests/conftest.py)."""

import os

import pytest
from hypothesis import given, settings, strategies as st

DRAWN = []


@settings(max_examples=5, deadline=None)
@given(st.integers(min_value=0, max_value=10**9))
def _draw(x):
    DRAWN.append(x)


def test_the_examples_are_the_same_on_every_run():
    if os.environ.get("HYPOTHESIS_PROFILE", "deterministic") != "deterministic":
        pytest.skip("HYPOTHESIS_PROFILE asks for new examples (exploring on purpose)")
    assert settings.default.derandomize
    _draw()
    first = list(DRAWN)
    DRAWN.clear()
    _draw()
    assert DRAWN == first
