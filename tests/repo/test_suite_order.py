"""`make test` hands the longest files out first (tests/conftest.py): a renamed or removed file must not drop out of
that order unnoticed, and a file listed there is one of the slow tier."""

from __future__ import annotations

from tests.conftest import LONGEST_FILES, REPO


def test_every_file_the_suite_starts_first_exists_and_holds_slow_tests():
    for name in LONGEST_FILES:
        path = REPO / name
        assert path.is_file(), name
        assert "pytest.mark.slow" in path.read_text(), name


def test_make_test_keeps_the_order_the_conftest_gives():
    makefile = (REPO / "Makefile").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in makefile
