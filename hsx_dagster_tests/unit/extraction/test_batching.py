import numpy as np
import pytest

from hsx_dagster.core.extraction import LengthOrder, padding_efficiency, plan_batches


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


def test_cutting_one_batch_at_a_time_with_changing_shapes_covers_every_sample_once():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 2000).astype(int), 1, 6000)
    order = LengthOrder(lengths)
    assert len(order) == 2000 and order.remaining_tokens == int(lengths.sum())
    rows, previous_longest = [], None
    while len(order):
        batch_size, budget = int(rng.integers(1, 64)), int(2 ** rng.integers(6, 15))
        longest_left, tokens_left = order.next_length, order.remaining_tokens
        peeked = order.peek(batch_size, budget)
        batch = order.take(batch_size, budget)
        assert batch == peeked and batch.longest == longest_left == max(lengths[list(batch.rows)])
        assert batch.real_tokens == sum(lengths[list(batch.rows)])
        assert order.remaining_tokens == tokens_left - batch.real_tokens
        assert len(batch.rows) <= batch_size and (batch.computed_tokens <= budget or len(batch.rows) == 1)
        # as many rows as both budgets allow: one more would break one of them
        if len(order) and len(batch.rows) < batch_size:
            assert (len(batch.rows) + 1) * batch.longest > budget
        assert previous_longest is None or batch.longest <= previous_longest
        previous_longest = batch.longest
        rows += batch.rows
    assert sorted(rows) == list(range(2000)) and order.next_length == 0 and order.remaining_tokens == 0
    with pytest.raises(IndexError):
        order.take(8, 1024)


@pytest.mark.parametrize("batch_size, budget", [(1, 10_000), (4, 100), (32, 8192), (1000, 10**9)])
def test_one_shape_cut_by_cut_is_the_plan(batch_size, budget):
    lengths = np.random.default_rng(2).integers(1, 3000, 500)
    order = LengthOrder(lengths)
    cut = []
    while len(order):
        cut.append(order.take(batch_size, budget))
    assert cut == plan_batches(lengths, batch_size, budget)
