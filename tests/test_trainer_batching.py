"""Token-budget micro-batches and optimizer steps, as properties over random length
lists (hypothesis): every row exactly once, budgets kept, lengths binned, steps of
about the same number of tokens, ranks given equal shares, the same for a seed."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nightshift.trainer.batching import cost, micro_batches, optimizer_steps, shard

lengths_st = st.lists(st.integers(1, 3000), min_size=1, max_size=300)
FAST = settings(max_examples=60, deadline=None)


def _rows(batches) -> list[int]:
    return sorted(i for mb in batches for i in mb)


@FAST
@given(lengths=lengths_st, budget=st.integers(256, 8192), packed=st.booleans(), seed=st.integers(0, 2**16))
def test_every_row_once_and_every_micro_batch_within_budget(lengths, budget, packed, seed):
    mbs = micro_batches(lengths, budget, packed=packed, seed=seed)
    assert _rows(mbs) == list(range(len(lengths)))
    for mb in mbs:
        assert mb and (cost(mb, lengths, packed) <= budget or len(mb) == 1)
    assert mbs == micro_batches(lengths, budget, packed=packed, seed=seed)  # deterministic for a seed
    # the costliest micro-batch comes first, so an out-of-memory error comes on step 1
    assert cost(mbs[0], lengths, packed) == max(cost(mb, lengths, packed) for mb in mbs)


@FAST
@given(lengths=st.lists(st.integers(1, 1024), min_size=50, max_size=400), seed=st.integers(0, 2**16))
def test_packed_micro_batches_are_nearly_full(lengths, seed):
    """First-fit-decreasing leaves room only where nothing left fits: all but the
    last few micro-batches of each megabatch are at least 3/4 full."""
    budget = 4096
    mbs = micro_batches(lengths, budget, packed=True, seed=seed)
    full = [cost(mb, lengths, True) >= 0.75 * budget for mb in mbs]
    assert sum(full) >= len(mbs) - max(2, len(mbs) // 10)
    assert len(mbs) <= sum(lengths) / (0.75 * budget) + 3


def test_padded_micro_batches_bin_rows_of_like_length():
    """Padding wasted by binning, against the same budget with rows in random order."""
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(7, 0.6)) + 1 for _ in range(2000)]
    mbs = micro_batches(lengths, 16384, packed=False, seed=0)
    waste = sum(cost(mb, lengths, False) for mb in mbs) / sum(lengths) - 1
    order = list(range(len(lengths)))
    rng.shuffle(order)
    naive, i = [], 0
    while i < len(order):  # rows in arrival order, as many as the budget takes
        mb = [order[i]]
        i += 1
        while i < len(order) and (len(mb) + 1) * max(lengths[j] for j in mb + [order[i]]) <= 16384:
            mb.append(order[i])
            i += 1
        naive.append(mb)
    naive_waste = sum(cost(mb, lengths, False) for mb in naive) / sum(lengths) - 1
    assert waste < 0.1 < naive_waste


def test_a_different_seed_gives_another_order():
    lengths = [100 + i for i in range(500)]
    a = micro_batches(lengths, 2048, packed=True, seed=0)
    b = micro_batches(lengths, 2048, packed=True, seed=1)
    assert a != b and _rows(a) == _rows(b)


@FAST
@given(lengths=st.lists(st.integers(1, 1024), min_size=1, max_size=400), per_step=st.integers(4, 8),
       seed=st.integers(0, 2**16))
def test_steps_carry_about_tokens_per_step(lengths, per_step, seed):
    """Within 10 % of tokens_per_step, the epoch's last step apart, when rows are at
    most a quarter of a micro-batch and a step holds at least 4 micro-batches."""
    budget = 4096
    tokens_per_step = per_step * budget
    mbs = micro_batches(lengths, budget, packed=True, seed=seed)
    steps = optimizer_steps(mbs, lengths, tokens_per_step=tokens_per_step)
    assert _rows([mb for s in steps for mb in s]) == list(range(len(lengths)))
    sizes = [sum(lengths[i] for mb in s for i in mb) for s in steps]
    for n in sizes[:-1]:
        assert abs(n / tokens_per_step - 1) <= 0.10, sizes


@FAST
@given(lengths=lengths_st, rows=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_steps_by_rows_have_exactly_that_many_rows(lengths, rows, seed):
    mbs = micro_batches(lengths, 4096, packed=True, seed=seed)
    steps = optimizer_steps(mbs, lengths, rows_per_step=rows)
    counts = [sum(len(mb) for mb in s) for s in steps]
    assert all(c == rows for c in counts[:-1]) and 0 < counts[-1] <= rows
    assert _rows([mb for s in steps for mb in s]) == list(range(len(lengths)))
    assert all(cost(mb, lengths, True) <= 4096 or len(mb) == 1 for s in steps for mb in s)


@FAST
@given(lengths=st.lists(st.integers(1, 3000), min_size=8, max_size=300), world=st.integers(2, 4),
       packed=st.booleans(), seed=st.integers(0, 2**16))
def test_each_rank_gets_the_same_number_of_micro_batches_and_every_row_once(lengths, world, packed, seed):
    mbs = micro_batches(lengths, 4096, packed=packed, seed=seed)
    steps = optimizer_steps(mbs, lengths, tokens_per_step=16384, world_size=world, micro_batch_tokens=4096,
                            packed=packed)
    seen = []
    for s in steps:
        shares = [shard(s, r, world) for r in range(world)]
        assert len({len(x) for x in shares}) == 1 and all(len(x) >= 1 for x in shares)
        seen += [mb for x in shares for mb in x]
        assert all(mb for mb in s)  # padded with nothing: no empty micro-batch
    assert _rows(seen) == list(range(len(lengths)))
    assert all(cost(mb, lengths, packed) <= 4096 or len(mb) == 1 for mb in seen)


def test_ranks_are_balanced_by_tokens():
    rng = random.Random(0)
    lengths = [int(rng.uniform(200, 2000)) for _ in range(3000)]
    mbs = micro_batches(lengths, 8192, packed=True, seed=0)
    steps = optimizer_steps(mbs, lengths, tokens_per_step=65536, world_size=4, micro_batch_tokens=8192, packed=True)
    for s in steps[:-1]:
        load = [sum(lengths[i] for mb in shard(s, r, 4) for i in mb) for r in range(4)]
        assert max(load) - min(load) <= 0.05 * max(load), load


def test_a_step_that_does_not_divide_splits_a_micro_batch():
    lengths = [100] * 12
    mbs = [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    (step,) = optimizer_steps(mbs, lengths, tokens_per_step=1200, world_size=2, packed=True)
    assert len(step) == 4 and _rows(step) == list(range(12))
    assert [len(mb) for mb in shard(step, 0, 2)] != [] and len(shard(step, 1, 2)) == 2


def test_single_row_micro_batches_that_cannot_be_shared_are_a_clear_error():
    with pytest.raises(ValueError, match="3 micro-batches of one row each cannot be shared equally by 2 ranks"):
        optimizer_steps([[0], [1], [2]], [5000, 5000, 5000], tokens_per_step=5000, world_size=2, packed=True)
    with pytest.raises(ValueError, match="1 rows cannot give each of 2 ranks"):
        optimizer_steps([[0]], [10], tokens_per_step=10, world_size=2, packed=True)
    with pytest.raises(ValueError, match="say packed=True or False"):
        optimizer_steps([[0], [1]], [10, 10], tokens_per_step=10, world_size=2)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="row 1 has 0 tokens"):
        micro_batches([3, 0], 1024, packed=True, seed=0)
    with pytest.raises(ValueError, match="micro_batch_tokens must be at least 1"):
        micro_batches([3], 0, packed=True, seed=0)
    with pytest.raises(ValueError, match="tokens_per_step or rows_per_step"):
        optimizer_steps([[0]], [3], tokens_per_step=10, rows_per_step=2)
    with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
        shard([[0], [1]], 2, 2)
    assert micro_batches([], 1024, packed=True, seed=0) == []
    assert optimizer_steps([], [], tokens_per_step=10) == []
