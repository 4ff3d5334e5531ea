"""Dated experiment records (not part of the hpa wheel); tools/ holds the sweep tooling that made them."""
