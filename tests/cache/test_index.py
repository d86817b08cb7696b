import numpy as np

from cache.index import NamespaceIndex


def unit(rng, n, dim=16):
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_flat_then_hnsw_search_remove_and_shrink_back():
    rng = np.random.default_rng(0)
    vecs = unit(rng, 300)
    index = NamespaceIndex(16, hnsw_threshold=100)
    index.add(np.arange(50), vecs[:50])
    assert not index.approximate
    assert index.search(vecs[7], 1)[0][0] == 7
    index.add(np.arange(50, 300), vecs[50:])
    assert index.approximate and len(index) == 300
    assert index.search(vecs[123], 1)[0][0] == 123
    np.testing.assert_allclose(index.vector(123), vecs[123], atol=1e-6)
    index.remove(123)
    assert all(i != 123 for i, _ in index.search(vecs[123], 5))
    for i in range(300):
        if i != 5:
            index.remove(i)
    assert len(index) == 1
    assert not index.approximate  # rebuilt as exact once small again
    assert index.search(vecs[5], 3) == [(5, index.search(vecs[5], 1)[0][1])]
