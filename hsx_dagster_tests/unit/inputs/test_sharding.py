import numpy as np

from hsx_dagster.core.inputs import assign_shards, imbalance, shard_loads


def test_long_tailed_lengths_balance_within_a_percent():
    rng = np.random.default_rng(0)
    tokens = np.clip(rng.lognormal(5.5, 0.8, size=5000).astype(int), 8, 8000)
    ids = rng.permutation(5000)
    assignment = assign_shards(tokens, ids, 8)
    loads = shard_loads(tokens, assignment, 8)
    assert loads.sum() == tokens.sum()
    assert imbalance(loads) < 1.01
    # A naive round-robin split of the same data is measurably worse.
    naive = shard_loads(tokens, np.arange(5000) % 8, 8)
    assert imbalance(naive) > imbalance(loads)


def test_assignment_is_deterministic_and_order_independent():
    tokens = np.array([100, 100, 50, 50, 25, 300])
    ids = np.array([6, 5, 4, 3, 2, 1])
    first = assign_shards(tokens, ids, 3)
    again = assign_shards(tokens, ids, 3)
    assert np.array_equal(first, again)
    permutation = np.array([5, 3, 1, 0, 4, 2])
    shuffled = assign_shards(tokens[permutation], ids[permutation], 3)
    assert np.array_equal(shuffled, first[permutation])


def test_one_shard_and_empty():
    assert assign_shards([5, 6], [1, 2], 1).tolist() == [0, 0]
    assert len(assign_shards([], [], 4)) == 0
    assert imbalance(np.array([10, 10])) == 1.0


def test_membership_is_stable_as_samples_come_and_go():
    rng = np.random.default_rng(1)
    tokens, ids = rng.integers(10, 2000, size=400), np.arange(400) * 7 + 3
    first = assign_shards(tokens[:360], ids[:360], 4)
    # 40 new samples, 30 old ones gone (an input file edited in place is both), one more shard
    kept = np.r_[30:360]
    tokens2, ids2 = np.r_[tokens[kept], tokens[360:]], np.r_[ids[kept], ids[360:]]
    second = assign_shards(tokens2, ids2, 5, previous=(ids[:360], first))
    assert (second[: len(kept)] == first[kept]).all()  # every remaining sample kept its shard
    new_loads = shard_loads(tokens2[len(kept) :], second[len(kept) :], 5)
    assert new_loads[4] == new_loads.max()  # the new, empty shard took most of the new work
    # fewer shards: the samples of the dropped ones are new to the others, the rest stay put
    third = assign_shards(tokens2, ids2, 3, previous=(ids2, second))
    stayed = second < 3
    assert (third[stayed] == second[stayed]).all() and third.max() == 2
