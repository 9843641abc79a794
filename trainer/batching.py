"""Micro-batches by tokens, optimizer steps by tokens, steps shared by ranks.

Agent calls range from a few hundred to 16k tokens, so a batch of N rows is
sometimes tiny and sometimes out of memory. Here the memory plan fixes a token
budget per forward (`micro_batch_tokens`) and a run fixes one per optimizer step
(`tokens_per_step`); rows are binned by length so a micro-batch is full (packed)
or barely padded, and gradient accumulation carries the rest of the step.

Binning is HF's `group_by_length` recipe with tokens in place of rows: shuffle,
cut into megabatches of about `MEGABATCH` micro-batches' worth of tokens, sort
each by length, then first-fit-decreasing into micro-batches. The shuffle keeps
epochs random and the megabatch keeps lengths local; micro-batches are then
shuffled again and the one costing the most memory goes first, so an
out-of-memory error (and the plan's retry) comes on step 1, not at 3 a.m.

All functions return row indices and are deterministic for a seed: every rank of
a multi-GPU run computes the same steps and takes its own share (`shard`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: Micro-batches' worth of tokens sorted together: wide enough that rows of like
#: length meet, narrow enough that order stays random (HF sorts 50 batches).
MEGABATCH = 50
#: Micro-batches looked at to fill the end of an optimizer step closest to its budget.
LOOKAHEAD = 8


def _check(lengths: Sequence[int], budget: int, what: str) -> None:
    if budget < 1:
        raise ValueError(f"{what} must be at least 1 token, not {budget}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"row {i} has {n} tokens: every row needs at least one")


def cost(batch: Sequence[int], lengths: Sequence[int], packed: bool) -> int:
    """Tokens a micro-batch computes on: their sum packed, rows x the longest padded."""
    if not batch:
        return 0
    return sum(lengths[i] for i in batch) if packed else len(batch) * max(lengths[i] for i in batch)


def _bin(order: list[int], lengths: Sequence[int], budget: int, packed: bool) -> list[list[int]]:
    """First-fit-decreasing of rows sorted longest first into bins of <= budget
    tokens; a row longer than the budget gets a bin of its own."""
    bins: list[list[int]] = []
    if not packed:  # sorted longest first, the first row of a bin sets its width
        for i in order:
            if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
                bins[-1].append(i)
            else:
                bins.append([i])
        return bins
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def micro_batches(lengths: Sequence[int], micro_batch_tokens: int, *, packed: bool, seed: int) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most `micro_batch_tokens` tokens
    (packed: their sum; padded: rows x the longest), each row exactly once, rows of
    like length together, the costliest micro-batch first, the rest shuffled."""
    _check(lengths, micro_batch_tokens, "micro_batch_tokens")
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    out: list[list[int]] = []
    mega: list[int] = []
    tokens = 0
    for i in order + [-1]:
        if i >= 0:
            mega.append(i)
            tokens += lengths[i]
        if mega and (i < 0 or tokens >= MEGABATCH * micro_batch_tokens):
            mega.sort(key=lambda j: (-lengths[j], j))
            out += _bin(mega, lengths, micro_batch_tokens, packed)
            mega, tokens = [], 0
    rng.shuffle(out)
    if out:
        worst = max(range(len(out)), key=lambda b: (cost(out[b], lengths, packed), -b))
        out[0], out[worst] = out[worst], out[0]
    return out


def _split(batch: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two halves of a micro-batch of >= 2 rows, as equal in tokens as a greedy split
    makes them (longest rows first to the lighter half)."""
    a: list[int] = []
    b: list[int] = []
    ta = tb = 0
    for i in sorted(batch, key=lambda j: (-lengths[j], j)):
        if ta <= tb:
            a.append(i)
            ta += lengths[i]
        else:
            b.append(i)
            tb += lengths[i]
    return a, b


def _tokens(batch: Sequence[int], lengths: Sequence[int]) -> int:
    return sum(lengths[i] for i in batch)


def _by_tokens(mbs: list[list[int]], lengths: Sequence[int], budget: int) -> list[list[list[int]]]:
    """Consecutive micro-batches into steps of about `budget` tokens: a step takes
    micro-batches while that brings it closer to the budget, and fills its end
    with the best-fitting one among the next `LOOKAHEAD`."""
    pending = list(mbs)
    steps: list[list[list[int]]] = []
    while pending:
        step, total = [pending.pop(0)], 0
        total = _tokens(step[0], lengths)
        while pending and total < budget:
            window = pending[:LOOKAHEAD]
            gap = budget - total
            j = min(range(len(window)), key=lambda k: (abs(gap - _tokens(window[k], lengths)), k))
            t = _tokens(window[j], lengths)
            if abs(total + t - budget) > abs(total - budget):
                break
            step.append(pending.pop(j))
            total += t
        steps.append(step)
    return steps


def _by_rows(mbs: list[list[int]], lengths: Sequence[int], rows: int) -> list[list[list[int]]]:
    """Consecutive micro-batches into steps of exactly `rows` rows (the last may have
    fewer): a micro-batch across a step's end is cut in two there."""
    steps: list[list[list[int]]] = []
    step: list[list[int]] = []
    n = 0
    for mb in mbs:
        mb = list(mb)
        while mb:
            take = mb[: rows - n]
            mb = mb[rows - n:]
            step.append(take)
            n += len(take)
            if n == rows:
                steps.append(step)
                step, n = [], 0
    if step:
        steps.append(step)
    return steps


def _deal_batches(step: list[list[int]], lengths: Sequence[int], world_size: int,
                  packed: bool) -> list[list[int]] | None:
    """The fallback of `_deal`: the step's micro-batches kept whole, the heaviest
    split until `world_size` divides their number, then dealt heaviest first to
    the lightest rank that still has room. None if too few can be split."""
    step = [list(mb) for mb in step]
    while len(step) % world_size:
        splittable = [k for k, mb in enumerate(step) if len(mb) > 1]
        if not splittable:
            return None
        k = max(splittable, key=lambda k: (cost(step[k], lengths, packed), -k))
        step[k:k + 1] = list(_split(step[k], lengths))
    per = len(step) // world_size
    ranks: list[list[list[int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for mb in sorted(step, key=lambda mb: (-_tokens(mb, lengths), mb)):
        r = min((r for r in range(world_size) if len(ranks[r]) < per), key=lambda r: (load[r], r))
        ranks[r].append(mb)
        load[r] += _tokens(mb, lengths)
    return [ranks[r][j] for j in range(per) for r in range(world_size)]


def _deal(step: list[list[int]], lengths: Sequence[int], world_size: int, budget: int,
          packed: bool) -> list[list[int]] | None:
    """A step's rows dealt to `world_size` ranks: longest first to the rank with the
    fewest tokens, each rank's rows binned into micro-batches of <= `budget`, and a
    rank with fewer micro-batches than another splitting its heaviest until all
    have the same number. Laid out so that rank r's are step[r::world_size]. Where
    that cannot give every rank as many micro-batches (rows too long to share
    one), the step's own micro-batches are dealt instead (`_deal_batches`); None
    if neither can (fewer rows than ranks, say)."""
    rows = sorted((i for mb in step for i in mb), key=lambda i: (-lengths[i], i))
    if len(rows) < world_size:
        return None
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in rows:
        r = min(range(world_size), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    binned = [_bin(rs, lengths, budget, packed) for rs in ranks]
    want = max(len(b) for b in binned)
    for bins in binned:
        while len(bins) < want:
            splittable = [k for k, mb in enumerate(bins) if len(mb) > 1]
            if not splittable:
                return _deal_batches(step, lengths, world_size, packed)
            k = max(splittable, key=lambda k: (cost(bins[k], lengths, packed), -k))
            bins[k:k + 1] = list(_split(bins[k], lengths))
    return [binned[r][j] for j in range(want) for r in range(world_size)]


def optimizer_steps(micro_batches: list[list[int]], lengths: Sequence[int], *, tokens_per_step: int = 0,
                    rows_per_step: int = 0, world_size: int = 1, micro_batch_tokens: int = 0,
                    packed: bool | None = None) -> list[list[list[int]]]:
    """Micro-batches grouped into optimizer steps: about `tokens_per_step` tokens
    each (or exactly `rows_per_step` rows, a micro-batch across the boundary cut
    in two), in order.

    With `world_size` ranks, each step's rows are dealt to the ranks with balanced
    tokens and re-binned into micro-batches of at most `micro_batch_tokens` (default:
    the largest given; `packed` as in `micro_batches`, required), the same number for every
    rank (a micro-batch is split where they would differ; nothing is padded): rank
    r's are `shard(step, r, world_size)`. A step whose rows cannot be shared so
    (fewer rows than ranks) joins the next one, the last one the one before."""
    if (tokens_per_step > 0) == (rows_per_step > 0):
        raise ValueError("optimizer_steps: give tokens_per_step or rows_per_step (one of them, above 0)")
    if world_size < 1:
        raise ValueError(f"optimizer_steps: world_size must be at least 1, not {world_size}")
    rows = sum(len(mb) for mb in micro_batches)
    if rows and rows < world_size:
        raise ValueError(f"optimizer_steps: {rows} rows cannot give each of {world_size} ranks a micro-batch")
    mbs = [list(mb) for mb in micro_batches if mb]
    steps = _by_tokens(mbs, lengths, tokens_per_step) if tokens_per_step > 0 else _by_rows(mbs, lengths, rows_per_step)
    if world_size == 1:
        return steps
    if packed is None:
        raise ValueError("optimizer_steps: say packed=True or False with several ranks (each rank's rows are "
                         "binned again, packed or padded)")
    budget = micro_batch_tokens or max((cost(mb, lengths, packed) for mb in mbs), default=1)
    out: list[list[list[int]]] = []
    carry: list[list[int]] = []
    for step in steps:
        dealt = _deal(carry + step, lengths, world_size, budget, packed)
        carry = [] if dealt is not None else carry + step
        if dealt is not None:
            out.append(dealt)
    while carry:  # what is left at the end goes back into the steps before it
        if not out:
            raise ValueError(f"optimizer_steps: {len(carry)} micro-batches of one row each cannot be shared equally "
                             f"by {world_size} ranks")
        prev = out.pop()
        dealt = _deal(prev + carry, lengths, world_size, budget, packed)
        carry = [] if dealt is not None else prev + carry
        if dealt is not None:
            out.append(dealt)
    return out


def shard(step: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches of a step from `optimizer_steps`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"shard: rank {rank} is not one of {world_size} ranks")
    if len(step) % world_size:
        raise ValueError(f"shard: a step of {len(step)} micro-batches does not divide among {world_size} ranks")
    return step[rank::world_size]
