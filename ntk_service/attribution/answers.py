"""The usual questions, answered from score tiles in memory bounded by the answer: top-k proponents and opponents.

``top_influences`` reduces a stream of ``ScoreTile`` to the k largest and k smallest scores of every test example
(2·M·k values), merging each tile's candidates into the running ones, so the (M, N) matrix is never held: a job
can stream tiles from the scorer (or from its store) through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ntk_service.attribution.scoring import ScoreTile
from ntk_service.errors import InvalidInput

__all__ = ["RunningTop", "TopInfluences", "top_influences"]


@dataclass(frozen=True)
class TopInfluences:
    """The strongest training examples for each test example.

    Attributes:
        proponents: (M, k) int64 training indices with the largest scores, largest first.
        proponent_scores: (M, k) float32, their scores.
        opponents: (M, k) int64 training indices with the smallest (most negative) scores, smallest first.
        opponent_scores: (M, k) float32, their scores.
    """

    proponents: np.ndarray
    proponent_scores: np.ndarray
    opponents: np.ndarray
    opponent_scores: np.ndarray


MERGE_ENTRIES = 1 << 20
"""Scores a tile is merged by at a time (whole test rows of it).

NOTE [merge memory]
    Merging a tile makes a negated copy of it (float32) and the positions that ``argpartition`` returns (int64):
    12 bytes per score, three times the tile itself (measured by tests/jobs/scoring_peak.py). Merged a slab of rows
    at a time, they stay at about 12 MiB whatever the tile; the rows are independent, so the answer is the same bits.
"""


def _merge(vals: np.ndarray, idx: np.ndarray, block: np.ndarray, offset: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of the running (vals, idx) and the block's columns (indices offset + column)."""
    if block.shape[1] > k:
        part = np.argpartition(-block, k - 1, axis=1)[:, :k]
        cand_vals, cand_idx = np.take_along_axis(block, part, axis=1), part + offset
    else:
        cand_vals = block
        cand_idx = np.broadcast_to(np.arange(block.shape[1], dtype=np.int64) + offset, block.shape)
    all_vals = np.concatenate([vals, cand_vals], axis=1)
    all_idx = np.concatenate([idx, cand_idx], axis=1)
    if all_vals.shape[1] <= k:
        return all_vals, all_idx
    best = np.argpartition(-all_vals, k - 1, axis=1)[:, :k]
    return np.take_along_axis(all_vals, best, axis=1), np.take_along_axis(all_idx, best, axis=1)


class RunningTop:
    """The k largest and k smallest scores of each test example seen so far, merged tile by tile: ``top_influences``
    over a stream that may stop and go on (a job saves ``arrays()`` after each unit and resumes ``from_arrays``).

    Example::

        >>> running = RunningTop(n_test=100, n_train=5000, k=10)
        >>> for tile in tiles:                                                   # doctest: +SKIP
        ...     running.add(tile)
        >>> running.result().proponents.shape                                   # (100, 10)

    Args:
        n_test (int): M. n_train (int): N. k (int): how many of each; in [1, N].

    Raises:
        InvalidInput: k < 1 or k > N.
    """

    def __init__(self, *, n_test: int, n_train: int, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_train:
            raise InvalidInput(f"top_influences: k must be an integer in [1, N={n_train}], got {k!r}")
        self.n_test, self.n_train, self.k = n_test, n_train, k
        self._running: dict[int, list[np.ndarray]] = {}
        self._seen = np.zeros(n_test, dtype=np.int64)

    def add(self, tile: ScoreTile) -> None:
        """Merge one tile's candidates.

        Raises:
            InvalidInput: a tile outside (M, N).
        """
        rows = slice(tile.test_start, tile.test_start + tile.block.shape[0])
        if rows.stop > self.n_test or tile.train_start + tile.block.shape[1] > self.n_train:
            raise InvalidInput(
                f"top_influences: a tile at ({tile.test_start}, {tile.train_start}) of shape {tile.block.shape} lies "
                f"outside the ({self.n_test}, {self.n_train}) scores"
            )
        r, width = tile.block.shape
        empty_v, empty_i = np.empty((r, 0), dtype=np.float32), np.empty((r, 0), dtype=np.int64)
        state = self._running.get(tile.test_start, [empty_v, empty_i, empty_v, empty_i])
        merged: list[list[np.ndarray]] = [[], [], [], []]
        step = max(1, MERGE_ENTRIES // max(1, width))  # NOTE [merge memory]
        for a in range(0, r, step):
            part = slice(a, min(r, a + step))
            block = tile.block[part]
            hv, hi = _merge(state[0][part], state[1][part], block, tile.train_start, self.k)
            lv, li = _merge(-state[2][part], state[3][part], -block, tile.train_start, self.k)
            for out, value in zip(merged, (hv, hi, -lv, li), strict=True):
                out.append(value)
        self._running[tile.test_start] = [np.concatenate(parts) for parts in merged]
        self._seen[rows] += width

    def arrays(self) -> dict[str, np.ndarray]:
        """The running state as plain arrays (``np.savez`` stores them; ``from_arrays`` reads them back)."""
        starts = sorted(self._running)
        out: dict[str, np.ndarray] = {"seen": self._seen.copy(), "starts": np.array(starts, dtype=np.int64)}
        for name, position in (("high", 0), ("high_index", 1), ("low", 2), ("low_index", 3)):
            parts = [self._running[s][position] for s in starts]
            dtype = np.int64 if position % 2 else np.float32
            padded = np.zeros((sum(p.shape[0] for p in parts), self.k), dtype=dtype)  # rows of every start, width k
            offset = 0
            for part in parts:
                padded[offset : offset + part.shape[0], : part.shape[1]] = part
                offset += part.shape[0]
            out[name] = padded
        out["widths"] = np.array([self._running[s][0].shape[1] for s in starts], dtype=np.int64)
        out["rows"] = np.array([self._running[s][0].shape[0] for s in starts], dtype=np.int64)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], *, n_test: int, n_train: int, k: int) -> RunningTop:
        """The accumulator ``arrays()`` saved, to go on merging."""
        running = cls(n_test=n_test, n_train=n_train, k=k)
        running._seen = np.array(arrays["seen"], dtype=np.int64)
        offset = 0
        for start, rows, width in zip(arrays["starts"], arrays["rows"], arrays["widths"], strict=True):
            part = slice(offset, offset + int(rows))
            running._running[int(start)] = [
                np.array(arrays[name][part, : int(width)]) for name in ("high", "high_index", "low", "low_index")
            ]
            offset += int(rows)
        return running

    def result(self) -> TopInfluences:
        """The answer, once every (test, train) pair was added exactly once.

        Raises:
            InvalidInput: tiles missing (or added twice).
        """
        if not (self._seen == self.n_train).all():
            raise InvalidInput(
                f"top_influences: the tiles covered {int(self._seen.min())}..{int(self._seen.max())} of the "
                f"N={self.n_train} training columns of some test rows; pass every tile exactly once"
            )
        k = self.k
        prop = np.zeros((self.n_test, k), dtype=np.int64)
        prop_s = np.zeros((self.n_test, k), dtype=np.float32)
        opp, opp_s = prop.copy(), prop_s.copy()
        for start, (hv, hi, lv, li) in self._running.items():
            stop = start + hv.shape[0]
            order = np.argsort(-hv, axis=1, kind="stable")
            prop[start:stop], prop_s[start:stop] = np.take_along_axis(hi, order, 1), np.take_along_axis(hv, order, 1)
            order = np.argsort(lv, axis=1, kind="stable")
            opp[start:stop], opp_s[start:stop] = np.take_along_axis(li, order, 1), np.take_along_axis(lv, order, 1)
        return TopInfluences(prop, prop_s, opp, opp_s)


def top_influences(tiles: Iterable[ScoreTile], *, n_test: int, n_train: int, k: int = 10) -> TopInfluences:
    """The k top proponents and opponents of each test example, from score tiles covering the (M, N) scores.

    Args:
        tiles (iterable of ScoreTile): e.g. ``iter_score_tiles(...)``; every (test, train) pair exactly once.
        n_test (int): M. n_train (int): N.
        k (int): how many of each; at most N. Default: 10.

    Returns:
        TopInfluences: (M, k) arrays, sorted (proponents descending, opponents ascending); ties in any order.

    Raises:
        InvalidInput: k < 1 or k > N; tiles outside (M, N) or not covering it.
    """
    running = RunningTop(n_test=n_test, n_train=n_train, k=k)
    for tile in tiles:
        running.add(tile)
    return running.result()
