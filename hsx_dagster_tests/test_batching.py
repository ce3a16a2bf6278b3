import numpy as np
import pytest

from hsx_dagster.core.extraction.batching import padding_efficiency, plan_batches


def test_batches_respect_both_budgets_and_cover_every_sample_once():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 1000).astype(int), 1, 6000)
    batches = plan_batches(lengths, batch_size=32, max_batch_tokens=8192)
    rows = [row for batch in batches for row in batch.rows]
    assert sorted(rows) == list(range(1000))
    for batch in batches:
        assert batch.longest == max(lengths[list(batch.rows)])
        assert batch.real_tokens == sum(lengths[list(batch.rows)])
        assert len(batch.rows) <= 32
        assert batch.computed_tokens <= 8192 or len(batch.rows) == 1  # a lone long sample runs alone
    assert [b.longest for b in batches] == sorted((b.longest for b in batches), reverse=True)  # longest first
    assert padding_efficiency(batches) > 0.9


@pytest.mark.parametrize("batch_size, budget", [(1, 10_000), (4, 100), (1000, 10**9)])
def test_edge_budgets(batch_size, budget):
    lengths = [5, 50, 500, 7]
    batches = plan_batches(lengths, batch_size, budget)
    assert sorted(r for b in batches for r in b.rows) == [0, 1, 2, 3]
    assert all(len(b.rows) <= batch_size for b in batches)


def test_empty():
    assert plan_batches([], 8, 100) == []
    assert padding_efficiency([]) == 1.0
