"""igraph's random numbers drawn ahead in blocks: the same numbers as scanpy's per-call RandomState mapping."""

from __future__ import annotations

import numpy as np
import pytest

from atlasflow.tl import _igraph_rng


class PerCall:
    """scanpy's mapping of igraph's calls onto a RandomState, one NumPy call per number (the reference)."""

    def __init__(self, seed):
        self.rng = np.random.RandomState(seed) if isinstance(seed, int) else seed

    def getrandbits(self, k):
        return self.rng.tomaxint() & ((1 << k) - 1)

    def random(self):
        return self.rng.random()

    def randint(self, a, b):
        return self.rng.randint(a, b + 1)

    def gauss(self, mu, sigma):
        return self.rng.normal(mu, sigma)


@pytest.mark.parametrize("block", [3, 1 << 16])
def test_same_numbers_and_end_state_as_per_call_draws(monkeypatch, block):
    """Every call in a random interleaving (refills across block ends, the per-call randint and gauss between
    them) returns the per-call number, and a caller's RandomState ends where per-call draws leave it."""
    monkeypatch.setattr(_igraph_rng, "BLOCK", block)
    calls = np.random.default_rng(1).choice(["bits", "bits", "random", "randint", "gauss"], size=2_000)
    ref_state, ours_state = np.random.RandomState(42), np.random.RandomState(42)
    ref, ours = PerCall(ref_state), _igraph_rng.IgraphRNG(ours_state)
    for i, c in enumerate(calls):
        if c == "bits":
            k = (32, 63, 7)[i % 3]
            assert ours.getrandbits(k) == ref.getrandbits(k), i
        elif c == "random":
            assert ours.random() == ref.random(), i
        elif c == "randint":
            assert ours.randint(0, 1000) == ref.randint(0, 1000), i
        else:
            assert ours.gauss(1.0, 2.0) == ref.gauss(1.0, 2.0), i
    ours.sync()
    a, b = ref_state.get_state(), ours_state.get_state()
    assert np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_leiden_partition_equals_the_per_call_mapping():
    """igraph's Leiden on a graph with these random numbers gives the per-call mapping's partition."""
    import igraph as ig
    import scipy.sparse as sp

    from atlasflow.tl.cluster import igraph_from_adjacency

    rng = np.random.default_rng(3)
    n = 3_000
    rows = np.repeat(np.arange(n), 10)
    cols = (rows + rng.integers(-40, 41, rows.size)) % n  # local neighbourhoods on a ring: many clusters
    adj = sp.csr_matrix((rng.random(rows.size), (rows, cols)), shape=(n, n))
    g, w = igraph_from_adjacency((adj + adj.T).tocsr())
    found = []
    for mapping in (PerCall(0), None):
        with _igraph_rng.igraph_seeded(0):
            if mapping is not None:
                ig.set_random_number_generator(mapping)
            found.append(g.community_leiden(weights=w, resolution=1.0, objective_function="modularity",
                                            n_iterations=2).membership)
    assert len(set(found[0])) > 5
    assert found[0] == found[1]
