import sys

sys.path.insert(0, "/app")

from intervals import merge  # noqa: E402 - the module the agent writes


def test_disjoint_intervals_stay():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_overlapping_intervals_merge():
    assert merge([(1, 4), (2, 3), (3, 8)]) == [(1, 8)]


def test_touching_intervals_merge():
    assert merge([(1, 2), (2, 5)]) == [(1, 5)]
