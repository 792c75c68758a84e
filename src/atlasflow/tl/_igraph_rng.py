"""igraph's random numbers from a NumPy RandomState, as scanpy seeds them, drawn ahead in blocks.

scanpy maps igraph's calls onto a ``RandomState``: ``getrandbits(k)`` is ``tomaxint()`` masked to k bits,
``random()`` is ``random()``, ``gauss`` is ``normal``. igraph's Leiden asks for one number per call, about
6.5 million calls at 1M cells, and a scalar NumPy call costs more than the Python callback around it.

Both calls Leiden makes take two 32-bit outputs of the RandomState's Mersenne Twister: ``tomaxint`` is a
64-bit draw (first output high) shifted right by one, ``random`` is ``(a >> 5, b >> 6)`` joined into 53
bits. So the raw outputs are drawn here in blocks and each call takes the next pair: the same numbers as
calling the RandomState each time, so scanpy's partitions, and the RandomState ends where those calls
leave it (``sync``).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

#: calls drawn ahead at a time (two raw 32-bit outputs each)
BLOCK = 1 << 16


class IgraphRNG:
    """igraph's random number interface (``getrandbits``, ``randint``, ``random``, ``gauss``) on a RandomState."""

    def __init__(self, random_state: int | np.random.RandomState | None):
        from sklearn.utils import check_random_state

        self._rng = check_random_state(random_state)
        self._start: tuple = ()  # the RandomState where the pairs drawn ahead begin (legacy state tuple)
        self._ahead: np.random.MT19937  # the bit generator that draws them
        self._drawn = 0  # pairs drawn ahead since _start
        self._pairs: Iterator[int] = iter(())  # the pairs of the last block not taken yet, as 64-bit ints
        self._restart()

    def _pair(self) -> int:
        """The next pair of 32-bit outputs as one 64-bit int (first output high); a new block when used up."""
        raw = self._ahead.random_raw(2 * BLOCK)
        self._pairs = iter((raw[0::2] << np.uint64(32) | raw[1::2]).tolist())
        self._drawn += BLOCK
        return next(self._pairs)

    def getrandbits(self, k: int) -> int:
        try:
            pair = next(self._pairs)
        except StopIteration:
            pair = self._pair()
        return (pair >> 1) & ((1 << k) - 1)  # tomaxint: the 64-bit draw >> 1

    def random(self) -> float:
        try:
            pair = next(self._pairs)
        except StopIteration:
            pair = self._pair()
        return ((pair >> 37) * 67108864.0 + ((pair & 0xFFFFFFFF) >> 6)) / 9007199254740992.0  # exact, as in C

    def randint(self, a: int, b: int) -> int:
        return self._per_call(lambda: self._rng.randint(a, b + 1))

    def gauss(self, mu: float, sigma: float) -> float:
        return self._per_call(lambda: self._rng.normal(mu, sigma))

    def _per_call(self, draw):
        """A draw that does not take one pair, made on the RandomState itself (Leiden makes none)."""
        self.sync()
        value = draw()
        self._restart()
        return value

    def sync(self) -> None:
        """Move the RandomState to where per-call draws would have left it (for the caller's RandomState after
        clustering, and before a draw made on it), and draw ahead from there."""
        taken = self._drawn - operator.length_hint(self._pairs)
        if taken:
            mt = _twister(self._start)
            mt.random_raw(2 * taken)
            key, pos = mt.state["state"]["key"], mt.state["state"]["pos"]
            _, _, _, has_gauss, cached = self._rng.get_state()
            self._rng.set_state(("MT19937", key, pos, has_gauss, cached))
        self._restart()

    def _restart(self) -> None:
        self._start = self._rng.get_state()
        self._ahead = _twister(self._start)
        self._drawn = 0
        self._pairs = iter(())


def _twister(legacy_state) -> np.random.MT19937:
    """A bit generator at a RandomState's (legacy tuple) position."""
    mt = np.random.MT19937()
    mt.state = {"bit_generator": "MT19937", "state": {"key": legacy_state[1], "pos": legacy_state[2]}}
    return mt


@contextmanager
def igraph_seeded(random_state) -> Iterator[None]:
    """Run igraph with random numbers from ``random_state``; restore Python's ``random`` afterwards."""
    import igraph as ig

    rng = IgraphRNG(random_state)
    ig.set_random_number_generator(rng)
    try:
        yield
    finally:
        ig.set_random_number_generator(random)
        rng.sync()
