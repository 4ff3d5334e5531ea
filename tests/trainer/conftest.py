"""Shared fixture of the trainer tests: a small demo task, its tokenizer and one initial policy."""

import pytest

from trainer_runs import make_demo


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo"))
