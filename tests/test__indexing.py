"""``_indexing.py``: the key expansion both result views use, and the row groups of a stepped read."""

from __future__ import annotations

import pytest

from ntk_service._indexing import expand_key, row_groups


def test_expand_key_fills_the_ellipsis_and_refuses_extra_indices() -> None:
    assert expand_key(3, 4, owner="R") == (3,)
    assert expand_key((1, ..., 2), 4, owner="R") == (1, slice(None), slice(None), 2)
    assert expand_key(..., 2, owner="R") == (slice(None), slice(None))
    with pytest.raises(IndexError, match="R: 3 indices for a result of 2 dimensions"):
        expand_key((0, 1, 2), 2, owner="R")


@pytest.mark.parametrize(
    ("wanted", "row_bytes", "block_bytes"),
    [(range(0, 100, 7), 8, 64), (range(3, 50, 1), 10, 95), (range(0, 10, 3), 1000, 10), (range(5, 5, 2), 8, 64)],
)
def test_row_groups_read_exactly_the_wanted_rows_in_bounded_spans(
    wanted: range, row_bytes: int, block_bytes: int
) -> None:
    spans = row_groups(wanted, row_bytes, block_bytes)
    read = [row for lo, hi in spans for row in range(lo, hi)[:: wanted.step]]
    assert read == list(wanted)
    for lo, hi in spans:
        assert lo < hi and lo in wanted
        assert (hi - lo) * row_bytes <= max(block_bytes, row_bytes)  # one row at least, else within the cap
