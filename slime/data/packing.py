"""Split a global rollout batch into data-parallel ranks and token-budgeted micro-batches.

Every rank calls `plan_micro_batches` on the same global lengths and gets the same plan, so no
communication is needed to agree on it. `plan[rank][mb]` is a list of sample indices whose
tokens are concatenated without padding (position ids reset per sample).

Invariants of a plan returned by `plan_micro_batches` (asserted by tests/test_packing.py):
1. Every index in `range(len(lengths))` appears exactly once across all ranks and micro-batches.
2. Every micro-batch is non-empty and its tokens are <= `max_tokens`: its summed length, or with `prompts`
   (shared prompts, slime/data/batch.py) `micro_batch_tokens`, a shared prompt counted once (with
   `allow_empty`, a rank short of samples gets EMPTY micro-batches at the end, run as dummy calls).
3. Every rank has the same number of micro-batches, and at least `min_micro_batches`:
   ZeRO-3 gathers parameters inside forward/backward, so a rank that ran one micro-batch fewer
   would leave the others waiting in a collective forever.
4. With `groups`, all samples of a group sit on one rank (they may span micro-batches there),
   so per-group estimators (GRPO/RLOO baselines) need no cross-rank communication.
5. Same input gives the same output: no randomness, ties broken by sample index.

Compute is balanced across ranks by `cost_fn`, not by token count, because attention makes a
long sample cost more than two samples of half its length; with shared prompts, a prompt is paid once by the
samples that share it.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")

Plan = list[list[list[int]]]
"""plan[rank][micro_batch] = sample indices into the global batch."""

Prompts = Sequence["tuple[Hashable, int] | None"]
"""Per sample, (key, length) of its prompt where micro-batches carry a prompt once for all the samples in them
that share it (slime/data/batch.py, share_prompts), or None for a sample that keeps its own copy."""


def micro_batch_tokens(indices: Sequence[int], lengths: Sequence[int], prompts: Prompts | None = None) -> int:
    """Tokens of a micro-batch's samples as build_micro_batch lays them out from its indices, `lengths` being
    their `Sample.row_len`: with `prompts`, the samples of one prompt carry it once (the first of them has it)."""
    return sum(lengths[i] for i in indices) - sum(prompts[i][1] for i in _prompt_left_out(indices, prompts))


def _prompt_left_out(indices: Sequence[int], prompts: Prompts | None) -> list[int]:
    """The samples of a micro-batch laid out without their prompt, which an earlier sample of theirs carries."""
    if prompts is None:
        return []
    left_out, seen = [], set()
    for i in indices:
        shared = prompts[i]
        if shared is not None and shared[0] in seen:
            left_out.append(i)
        elif shared is not None:
            seen.add(shared[0])
    return left_out


class _Bin:
    """A micro-batch being filled, its tokens kept as `micro_batch_tokens` counts them: a sample adds its length,
    less its prompt where the bin holds a sibling already."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.tokens = 0
        self.keys: set[Hashable] = set()

    def added(self, i: int, lengths: Sequence[int], prompts: Prompts) -> int:
        """Tokens sample i would add."""
        shared = prompts[i]
        return lengths[i] - (shared[1] if shared is not None and shared[0] in self.keys else 0)

    def add(self, i: int, lengths: Sequence[int], prompts: Prompts) -> None:
        self.tokens += self.added(i, lengths, prompts)
        self.items.append(i)
        if prompts[i] is not None:
            self.keys.add(prompts[i][0])


def default_cost(length: int, hidden_size: int = 4096) -> float:
    """Relative forward FLOPs of one sample of `length` tokens in a dense transformer.

    Per layer and token the matmuls cost ~24*h^2 FLOPs (QKV/O projections plus a 4h MLP), and
    causal attention costs ~2*h*L^2 per sequence (QK^T and AV, half the square). Dividing by
    2*h gives 12*h*L + L^2. With h=4096 the quadratic term is ~8% of the total at 4k tokens and
    ~40% at 32k. Pass `functools.partial(default_cost, hidden_size=...)` for another model.
    """
    return 12.0 * hidden_size * length + float(length) * length


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    max_tokens: int,
    dp_size: int,
    groups: Sequence[Hashable] | None = None,
    min_micro_batches: int = 1,
    cost_fn: Callable[[int], float] = default_cost,
    owners: Sequence[int] | None = None,
    extra_cost: Sequence[float] | None = None,
    allow_empty: bool = False,
    prompts: Prompts | None = None,
) -> Plan:
    """Assign samples to `dp_size` ranks (balanced compute) and pack each rank's share into
    the same number of non-empty micro-batches of at most `max_tokens` tokens.

    `owners` (no groups): the rank that holds each sample now. Balancing then starts from that
    assignment and swaps (or moves) samples between the heaviest and lightest ranks only while
    that narrows their gap, so rank-local batches exchange few samples; if that assignment
    cannot be packed, the plan is made as without owners.

    `extra_cost`: per-sample cost on top of cost_fn(length), e.g. a vision tower's work on the
    sample's image patches (the patches' tokens are already in the length).

    `prompts` (see `Prompts`): micro-batches carry a shared prompt once, and are filled by those tokens
    (`micro_batch_tokens`) rather than by summed lengths. Balancing counts a shared prompt once too: each of the m
    samples that share it pays for its response and 1/m of the prompt (`_prompts_shared`),
    exact where they sit in one micro-batch, as packing tries to put them. A sample balanced away from its
    siblings makes its new rank run the prompt again, so a plan with each prompt's samples as one unit is made too,
    and kept where it leaves the ranks more even by over PROMPTS_TOGETHER_GAIN (it may move more samples).

    Steps: Karmarkar-Karp largest differencing over units (samples, or whole groups) into
    `dp_size` parts with equal unit counts, refined by swaps between the heaviest and lightest
    rank; first-fit decreasing per rank; then ranks with fewer
    micro-batches than the busiest one split their costliest micro-batches until counts match.

    When most micro-batches hold a single sample and sample counts differ across ranks, a rank
    can need more micro-batches than another rank has samples. Without groups we then pack
    globally first and deal whole micro-batches to ranks (coarser balance, but feasible whenever
    the global packing is); with groups we retry balancing sample counts instead of cost.
    When every rank gets the same number of samples (no groups and len(lengths) divisible by
    dp_size, or equal-size groups in a count divisible by dp_size) a plan always exists.

    `allow_empty` (no groups): where no plan gives every rank the same number of non-empty micro-batches
    (a count not divisible by dp_size, or fewer samples than ranks), ranks short of samples get empty
    micro-batches at the end instead of an error. The trainer runs them as dummy calls, which ZeRO-3's
    lockstep needs; a plan that needs none is always preferred.
    """
    if allow_empty and groups is not None:
        raise ValueError("allow_empty is for plans without groups")
    _check_inputs(lengths, max_tokens=max_tokens, dp_size=dp_size, groups=groups,
                  min_micro_batches=min_micro_batches, allow_empty=allow_empty)
    if owners is not None and (groups is not None or len(owners) != len(lengths)
                               or any(not 0 <= r < dp_size for r in owners)):
        raise ValueError("owners needs one rank in [0, dp_size) per sample and no groups")
    if prompts is not None and len(prompts) != len(lengths):
        raise ValueError(f"prompts has {len(prompts)} entries for {len(lengths)} samples")
    sample_cost = [float(cost_fn(length)) for length in lengths]
    if extra_cost is not None:
        if len(extra_cost) != len(lengths):
            raise ValueError(f"extra_cost has {len(extra_cost)} entries for {len(lengths)} samples")
        sample_cost = [c + float(e) for c, e in zip(sample_cost, extra_cost)]
    if prompts is not None:
        sample_cost = _prompts_shared(sample_cost, prompts, cost_fn)
    args = (lengths, sample_cost, max_tokens, dp_size, min_micro_batches)
    if groups is None:
        singles = [[i] for i in range(len(lengths))]
        plan = ((owners is not None and _pack_per_rank(singles, sample_cost, *args, start=owners, prompts=prompts))
                or _pack_per_rank(singles, sample_cost, *args, prompts=prompts)
                or _pack_globally(*args, prompts=prompts)
                or (allow_empty and _pack_per_rank(singles, sample_cost, *args, start=owners, allow_empty=True,
                                                   prompts=prompts))
                or None)
        if plan is not None and prompts is not None and dp_size > 1:
            plan = _prompts_together_if_more_even(plan, sample_cost, extra_cost, cost_fn, args, prompts, owners)
    else:
        by_group: dict[Hashable, list[int]] = {}
        for i, g in enumerate(groups):
            by_group.setdefault(g, []).append(i)
        if len(by_group) < dp_size:
            raise ValueError(
                f"{len(by_group)} groups cannot cover {dp_size} data-parallel ranks: each group "
                f"stays on one rank and every rank needs samples. Use fewer data-parallel ranks "
                f"or more prompts per rollout batch.")
        units = list(by_group.values())  # first-seen order
        plan = (_pack_per_rank(units, [sum(sample_cost[i] for i in u) for u in units], *args, prompts=prompts)
                or _pack_per_rank(units, [float(len(u)) for u in units], *args, equal_count=False, prompts=prompts))
    if plan is None:
        raise ValueError(
            f"cannot give each of {dp_size} ranks the same number (>= min_micro_batches="
            f"{min_micro_batches}) of non-empty micro-batches under max_tokens={max_tokens}: "
            f"the busiest rank needs more micro-batches than another rank has samples "
            f"({len(lengths)} samples in all). Use fewer data-parallel ranks, raise the rollout "
            f"batch size, or raise train.max_tokens_per_gpu.")

    out = []
    for bins in plan:
        # Costliest first, so micro-batch j is of similar size on every rank (they run in
        # lockstep under ZeRO-3) and the memory peak shows up on the first step.
        bins = [sorted(b) for b in bins]
        bins.sort(key=lambda b: (-sum(sample_cost[i] for i in b), b[0] if b else len(lengths)))
        out.append(bins)
    return out


PROMPTS_TOGETHER_GAIN = 0.01  # how much more even (max / mean rank cost) a plan moving whole prompts must be


def _prompts_together_if_more_even(plan: Plan, sample_cost: Sequence[float], extra_cost: Sequence[float] | None,
                                   cost_fn: Callable[[int], float], args: tuple, prompts: Prompts,
                                   owners: Sequence[int] | None = None) -> Plan:
    """`plan` balanced sample by sample, or one balanced with each shared prompt's samples as one unit, whichever
    leaves the ranks more even by PROMPTS_TOGETHER_GAIN (`plan` on a tie: it moves fewer samples).

    Sample by sample, balancing prices a sample at its response and 1/m of its prompt, which holds only while its
    m siblings share a micro-batch; a sample moved away from its siblings makes its new rank run the whole prompt
    again. Over 200 small random GRPO batches (bench/packing.py) the ranks' max / mean cost was 1.055 on average
    (p90 1.127) sample by sample, 1.036 with whole prompts alone, 1.022 (p90 1.064) keeping the more even.

    With `owners`, whole prompts are balanced from where they are first (a prompt's unit starts on the rank that
    holds most of its samples, and moves or swaps only while that narrows the gap), then from scratch; the one
    from scratch is kept only where it is more even by PROMPTS_TOGETHER_GAIN again, as it may move every prompt.
    On the 200 batches above that moves 30% of the samples (48% from scratch alone), as even on average."""
    lengths, dp_size = args[0], args[3]
    units: dict[Hashable, list[int]] = {}
    for i, shared in enumerate(prompts):
        units.setdefault(("prompt", shared[0]) if shared is not None else ("sample", i), []).append(i)
    if len(units) < dp_size or len(units) == len(prompts):
        return plan  # too few prompts to go around, or no prompt shared: nothing to keep together
    together = list(units.values())
    weights = [sum(sample_cost[i] for i in u) for u in together]
    # From scratch; with owners, first from where most of each prompt's samples are (the lowest rank on a tie).
    starts = [None]
    if owners is not None:
        starts = [[max(range(dp_size), key=lambda r: (sum(owners[i] == r for i in u), -r)) for u in together], None]
    candidates = [plan] + [_pack_per_rank(together, weights, *args, equal_count=False, start=start, prompts=prompts)
                           for start in starts]

    def imbalance(candidate: Plan) -> float:
        ranks = [sum(_micro_batch_cost(mb, lengths, cost_fn, prompts, extra_cost) for mb in mbs) for mbs in candidate]
        return max(ranks) / (sum(ranks) / len(ranks))

    best, best_imbalance = plan, imbalance(plan)
    for candidate in candidates[1:]:  # fewest moves first: each later one must be more even by the margin
        if candidate is not None and (value := imbalance(candidate)) < best_imbalance - PROMPTS_TOGETHER_GAIN:
            best, best_imbalance = candidate, value
    return best


def _micro_batch_cost(mb: Sequence[int], lengths: Sequence[int], cost_fn: Callable[[int], float],
                      prompts: Prompts | None, extra_cost: Sequence[float] | None = None) -> float:
    """A packed micro-batch's cost, each shared prompt in it paid once."""
    cost = sum(cost_fn(lengths[i]) for i in mb) - sum(cost_fn(prompts[i][1])
                                                      for i in _prompt_left_out(mb, prompts))
    return cost + (sum(extra_cost[i] for i in mb) if extra_cost is not None else 0.0)


def _prompts_shared(sample_cost: Sequence[float], prompts: Prompts, cost_fn: Callable[[int], float]) -> list[float]:
    """Per-sample costs with each shared prompt paid once: the m samples that share a prompt of P tokens each give
    back (m - 1) / m of cost_fn(P). With cost_fn = default_cost that is exact: a response of r tokens after a shared
    prompt costs 12 h r + 2 r P + r^2 (its tokens, and their attention to the prompt and to each other), which is
    cost_fn(P + r) - cost_fn(P)."""
    sharing: dict[Hashable, int] = {}
    for shared in prompts:
        if shared is not None:
            sharing[shared[0]] = sharing.get(shared[0], 0) + 1
    out = list(sample_cost)
    for i, shared in enumerate(prompts):
        if shared is not None and sharing[shared[0]] > 1:
            m = sharing[shared[0]]
            out[i] -= float(cost_fn(shared[1])) * (m - 1) / m
    return out


def _pack_per_rank(units: list[list[int]], weights: Sequence[float], lengths: Sequence[int],
                   sample_cost: Sequence[float], max_tokens: int, dp_size: int, min_mb: int, *,
                   equal_count: bool = True, start: Sequence[int] | None = None,
                   allow_empty: bool = False, prompts: Prompts | None = None) -> Plan | None:
    """Balance unit weights over ranks (from scratch, or from the assignment `start`), then pack
    each rank; a rank short of samples: None, or (`allow_empty`) its micro-batches split as far as
    they go and empty ones after them. From `start`, a lone sample stays where it is (moving it would
    not narrow the gap), so a batch of one-sample mini-batches stays spread as it was generated.
    `equal_count`: ranks get unit counts within one (from `start`: swaps only, where its counts are equal)."""
    if start is None:
        parts = _karmarkar_karp(weights, dp_size, equal_count=equal_count)
    else:
        parts = [[] for _ in range(dp_size)]
        for u, rank in enumerate(start):
            parts[rank].append(u)
        equal_count = equal_count and len({len(p) for p in parts}) == 1  # keep equal counts: swap, don't move
    _even_out(parts, weights, allow_moves=not equal_count)
    ranks = [[i for u in part for i in units[u]] for part in parts]
    packed = [_first_fit_decreasing(idx, lengths, max_tokens, prompts) for idx in ranks]
    num_mb = max(min_mb, max(len(bins) for bins in packed))
    if any(len(idx) < num_mb for idx in ranks) and not allow_empty:
        return None
    for bins, idx in zip(packed, ranks):
        while len(bins) < min(num_mb, len(idx)):
            _split_costliest(bins, sample_cost)
        bins.extend([] for _ in range(num_mb - len(bins)))
    return packed


def _pack_globally(lengths: Sequence[int], sample_cost: Sequence[float], max_tokens: int,
                   dp_size: int, min_mb: int, *, prompts: Prompts | None = None) -> Plan | None:
    """Pack all samples, split up to dp_size * num_mb micro-batches, deal them out by cost."""
    bins = _first_fit_decreasing(range(len(lengths)), lengths, max_tokens, prompts)
    num_mb = max(min_mb, -(-len(bins) // dp_size))
    if len(lengths) < dp_size * num_mb:
        return None
    while len(bins) < dp_size * num_mb:
        _split_costliest(bins, sample_cost)
    # Exactly num_mb bins per part: the count is divisible, so no fillers are added.
    bin_cost = [sum(sample_cost[i] for i in b) for b in bins]
    parts = _karmarkar_karp(bin_cost, dp_size)
    _even_out(parts, bin_cost, allow_moves=False)
    return [[bins[b] for b in part] for part in parts]


def _check_inputs(lengths: Sequence[int], *, max_tokens: int, dp_size: int,
                  groups: Sequence[Hashable] | None, min_micro_batches: int, allow_empty: bool = False) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}; "
                         f"set train.max_tokens_per_gpu.")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}.")
    if min_micro_batches < 1:
        raise ValueError(f"min_micro_batches must be >= 1, got {min_micro_batches}.")
    if groups is not None and len(groups) != len(lengths):
        raise ValueError(f"groups has {len(groups)} entries but lengths has {len(lengths)}; "
                         f"pass one group id per sample.")
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sample {i} has length {length}; drop empty samples before packing.")
        if length > max_tokens:
            raise ValueError(
                f"sample {i} has {length} tokens, more than the micro-batch budget of "
                f"{max_tokens}. Raise train.max_tokens_per_gpu to at least {length} or lower "
                f"rollout.max_response_len so prompt + response fits.")
    needed = dp_size * min_micro_batches
    if not lengths or (len(lengths) < needed and not allow_empty):
        raise ValueError(
            f"{len(lengths)} samples cannot fill {dp_size} ranks x {min_micro_batches} non-empty "
            f"micro-batches (needs >= {needed}). Use fewer data-parallel ranks, raise the rollout "
            f"batch size or lower min_micro_batches.")


def _karmarkar_karp(costs: Sequence[float], k: int, *, equal_count: bool = True) -> list[list[int]]:
    """Largest differencing method into k parts (item counts within one if `equal_count`).

    Each partial solution starts as k parts (one chunk of k sorted items dealt one per part, or
    a single item and k-1 empty parts); the two with the largest spread are merged by pairing
    the heaviest part of one with the lightest of the other, which cancels their imbalance.
    Returns item indices per part.
    """
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    if equal_count:
        order = [-1] * (-len(order) % k) + order  # zero-cost fillers make the count divisible
        chunks = [order[s:s + k] for s in range(0, len(order), k)]
    else:
        chunks = [[i] + [-1] * (k - 1) for i in order]
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for tick, chunk in enumerate(chunks):
        parts = [(costs[i] if i >= 0 else 0.0, [i] if i >= 0 else []) for i in chunk]
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tick, parts))
    tick = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted heaviest first: pair a's heaviest with b's lightest.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    return [items for _, items in heap[0][2]]


def _even_out(parts: list[list[int]], weights: Sequence[float], *, allow_moves: bool) -> None:
    """Swap (or move) one unit between the heaviest and the lightest part while that narrows
    their gap, in place. KK deals sorted chunks, so with many parts and a long tail it leaves a
    few percent (dp=64: ~10%) that these swaps remove. A gap within tol (1e-4 of the mean part) is
    left alone, and an exchange must move more than tol and leave a gap narrower by more than tol:
    each step then lowers the sum of squared part weights by more than 2 tol^2, so it terminates.
    (With 0 < delta < gap alone, an exchange whose delta equals the gap, which only swaps which part
    is heavy, passed when rounding made delta one ulp smaller: with fractional costs, shared prompts'
    or image patches', the same unit moved back and forth for ever, every rank spinning in the plan.)"""
    sums = [sum(weights[u] for u in p) for p in parts]
    tol = 1e-4 * sum(sums) / len(parts)
    while True:
        hi = max(range(len(parts)), key=lambda r: (sums[r], -r))
        lo = min(range(len(parts)), key=lambda r: (sums[r], r))
        gap = sums[hi] - sums[lo]
        if gap <= tol:
            return
        # Best exchange moves delta = w(a) - w(b) closest to gap / 2, with 0 < delta < gap.
        cands = sorted((weights[b], b) for b in parts[lo])
        if allow_moves:
            cands.insert(0, (0.0, -1))  # -1: move a without taking anything back
        keys = [w for w, _ in cands]
        best = None  # (gap after, a, b)
        for a in parts[hi]:
            j = bisect.bisect_left(keys, weights[a] - gap / 2)
            for w_b, b in cands[max(0, j - 1):j + 1]:
                delta = weights[a] - w_b
                if tol < delta < gap - tol and (best is None or abs(gap - 2 * delta) < best[0]):
                    best = (abs(gap - 2 * delta), a, b)
        if best is None:
            return
        _, a, b = best
        parts[hi].remove(a)
        parts[lo].append(a)
        delta = weights[a]
        if b >= 0:
            parts[lo].remove(b)
            parts[hi].append(b)
            delta -= weights[b]
        sums[hi] -= delta
        sums[lo] += delta


def _first_fit_decreasing(indices: Sequence[int], lengths: Sequence[int],
                          max_tokens: int, prompts: Prompts | None = None) -> list[list[int]]:
    """Fewest bins of at most max_tokens (FFD is within 11/9 of optimal, usually optimal here). With `prompts`,
    a prompt's samples come one after another, and a sample goes to the first bin that already holds its prompt
    and has room for its response, else to the first bin with room for it whole."""
    if prompts is not None:
        return _first_fit_shared(indices, lengths, max_tokens, prompts)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def _first_fit_shared(indices: Sequence[int], lengths: Sequence[int], max_tokens: int,
                      prompts: Prompts) -> list[list[int]]:
    """`_first_fit_decreasing` filling bins by `micro_batch_tokens`. A prompt's samples come one after another
    (the prompt with the most tokens first, its longest sample first), so that they fill micro-batches together
    rather than being spread by their lengths; a sample without a shared prompt is a group of its own."""
    group: dict[Hashable, tuple[int, int]] = {}  # prompt key -> (its first sample, its tokens counted once)
    for i in indices:
        if prompts[i] is not None:
            key, p = prompts[i]
            first, tokens = group.get(key, (i, p))
            group[key] = (min(first, i), tokens + lengths[i] - p)
    def order(i: int) -> tuple[int, int, int, int]:
        first, tokens = group[prompts[i][0]] if prompts[i] is not None else (i, lengths[i])
        return -tokens, first, -lengths[i], i
    bins: list[_Bin] = []
    for i in sorted(indices, key=order):
        key = prompts[i][0] if prompts[i] is not None else None
        chosen = None  # the first bin that holds its prompt with room, else the first with room
        for b in bins:
            if b.added(i, lengths, prompts) <= max_tokens - b.tokens:
                if key is not None and key in b.keys:
                    chosen = b
                    break
                chosen = chosen or b
        if chosen is None:
            chosen = _Bin()
            bins.append(chosen)
        chosen.add(i, lengths, prompts)
    return [b.items for b in bins]


def _split_costliest(bins: list[list[int]], sample_cost: Sequence[float]) -> None:
    """Split the costliest bin with two or more samples into two bins of similar cost, in place."""
    splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
    assert splittable, "caller guarantees more samples than bins"
    b = max(splittable, key=lambda b: (sum(sample_cost[i] for i in bins[b]), -min(bins[b])))
    halves: list[list[int]] = [[], []]
    load = [0.0, 0.0]
    for i in sorted(bins[b], key=lambda i: (-sample_cost[i], i)):
        h = 0 if load[0] <= load[1] else 1
        halves[h].append(i)
        load[h] += sample_cost[i]
    bins[b] = halves[0]
    bins.append(halves[1])


def flatten_plan(plan: Plan) -> list[int]:
    """Sample indices in the order the plan runs them: rank, then micro-batch, then position."""
    return [i for rank in plan for mb in rank for i in mb]


def restore_order(plan: Plan, values: Sequence[T]) -> list[T]:
    """Put per-sample `values` listed in `flatten_plan(plan)` order back into sample-index order.

    Typical use: each rank returns per-sample results in plan order, the ranks' lists are
    concatenated rank by rank (all-gather), and this gives them back in rollout order.
    """
    order = flatten_plan(plan)
    if len(values) != len(order):
        raise ValueError(f"got {len(values)} values for a plan of {len(order)} samples.")
    out: list = [None] * len(order)
    for pos, i in enumerate(order):
        out[i] = values[pos]
    return out


def padded_fixed_batches(lengths: Sequence[int], *, micro_batch_size: int, dp_size: int,
                         allow_empty: bool = False, owners: Sequence[int] | None = None) -> Plan:
    """Baseline layout: contiguous equal chunks per rank, `micro_batch_size` samples per
    micro-batch in original order, each sample padded to the longest in its micro-batch.

    `allow_empty`: a count not divisible by dp_size gives rank r the contiguous share
    [r n / dp, (r + 1) n / dp) (rounded down), and ranks with fewer micro-batches get empty ones
    at the end (dummy calls); without it such a count is an error. `owners`: the rank that holds each
    sample now, rank after rank (as layout.distribute gathers them); where the ranks hold shares of those
    sizes already, in any order, every rank keeps its own (a lone sample stays where it was generated)."""
    n = len(lengths)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}.")
    if n == 0 or (n % dp_size and not allow_empty):
        raise ValueError(
            f"{n} samples do not split evenly over {dp_size} data-parallel ranks; make the "
            f"rollout batch size a multiple of the data-parallel size.")
    bounds = [r * n // dp_size for r in range(dp_size + 1)]
    owners = None if owners is None else list(owners)
    if owners is not None and owners == sorted(owners):
        held = [owners.count(r) for r in range(dp_size)]
        if sorted(held) == sorted(b - a for a, b in zip(bounds[:-1], bounds[1:])):
            bounds = [sum(held[:r]) for r in range(dp_size + 1)]
    plan = []
    for first, last in zip(bounds[:-1], bounds[1:]):
        plan.append([list(range(s, min(s + micro_batch_size, last)))
                     for s in range(first, last, micro_batch_size)])
    num_mb = max(1, max(len(rank) for rank in plan))
    for rank in plan:
        rank.extend([] for _ in range(num_mb - len(rank)))
    return plan


def pack_each_rank(lengths_by_rank: Sequence[Sequence[int]], *, max_tokens: int | None = None,
                   micro_batch_size: int | None = None, prompts_by_rank: Sequence[Prompts] | None = None) -> Plan:
    """Pack every rank's own samples where they are (no sample changes rank): first-fit decreasing
    under `max_tokens`, or consecutive chunks of `micro_batch_size` (the padded layout).

    plan[rank][mb] holds positions into lengths_by_rank[rank]. Every rank gets the same number of
    micro-batches; a rank that needs fewer gets EMPTY ones at the end, which the caller runs as a
    dummy call (the lockstep ZeRO-3 needs), rather than splitting its real work finer. `prompts_by_rank`:
    each rank's `Prompts` (packed only).
    """
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError("give exactly one of max_tokens (packed) and micro_batch_size (padded)")
    plan: Plan = []
    for rank, lengths in enumerate(lengths_by_rank):
        if micro_batch_size is not None:
            if micro_batch_size < 1:
                raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
            plan.append([list(range(s, min(s + micro_batch_size, len(lengths))))
                         for s in range(0, len(lengths), micro_batch_size)])
            continue
        too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
        if too_long:
            i, n = too_long[0]
            raise ValueError(f"sample {i} has {n} tokens, more than the micro-batch budget of {max_tokens}. "
                             "Raise train.logprob_max_tokens_per_gpu (or train.max_tokens_per_gpu).")
        bins = _first_fit_decreasing(range(len(lengths)), lengths, max_tokens,
                                     prompts_by_rank[rank] if prompts_by_rank is not None else None)
        plan.append([sorted(b) for b in bins])
    num_mb = max(1, max(len(bins) for bins in plan))
    for bins in plan:
        bins.extend([] for _ in range(num_mb - len(bins)))
    return plan


def packing_stats(lengths: Sequence[int], plan: Plan, *, max_tokens: int | None = None,
                  padded: bool = False, cost_fn: Callable[[int], float] = default_cost,
                  prompts: Prompts | None = None, pad_to: int = 1) -> dict:
    """Efficiency figures for a plan, comparable between packed and padded layouts. With `prompts` (packed), a
    micro-batch's tokens and cost count each shared prompt once, as `micro_batch_tokens` lays it out; with
    `pad_to` (sequence parallel: sp), a packed row is padded to a multiple of it, as `build_micro_batch` does.

    - real_token_fraction: real tokens / tokens the kernels process. Packed micro-batches
      process exactly their samples (1.0), but for the padding to a multiple of `pad_to`; a padded one
      processes size * longest.
    - budget_fill: mean over micro-batches of processed tokens / max_tokens (None if no budget).
    - compute_imbalance: max over ranks of summed cost / mean over ranks.
    - lockstep_imbalance: sum over micro-batch steps of the slowest rank's cost, over the mean
      rank cost; ranks wait for each other at every micro-batch under ZeRO-3, so this is the
      step-time overhead versus a perfect split.
    - num_micro_batches: micro-batches each rank runs (the max, if a plan were ragged).
    - max_micro_batch_tokens: processed tokens of the largest micro-batch (activation peak).
    - total_cost: summed cost over all ranks, padding included.
    """
    if padded:
        prompts = None

    def mb_tokens(mb: list[int]) -> int:  # an empty (dummy) micro-batch: 0
        return len(mb) * max((lengths[i] for i in mb), default=0) if padded else micro_batch_tokens(mb, lengths, prompts)

    def processed(mb: list[int]) -> int:
        tokens = mb_tokens(mb)
        return tokens if padded else tokens + -tokens % pad_to

    def mb_cost(mb: list[int]) -> float:
        if padded:
            return len(mb) * cost_fn(max(lengths[i] for i in mb)) if mb else 0.0
        return _micro_batch_cost(mb, lengths, cost_fn, prompts)

    costs = [[mb_cost(mb) for mb in rank] for rank in plan]
    tokens = [processed(mb) for rank in plan for mb in rank]
    rank_cost = [sum(c) for c in costs]
    mean_cost = sum(rank_cost) / len(rank_cost)
    num_mb = max(len(rank) for rank in plan)
    lockstep = sum(max(c[j] if j < len(c) else 0.0 for c in costs) for j in range(num_mb))
    real = sum(mb_tokens(mb) for rank in plan for mb in rank) if not padded else \
        sum(lengths[i] for i in flatten_plan(plan))
    return {
        "real_token_fraction": real / sum(tokens),
        "budget_fill": (sum(tokens) / (len(tokens) * max_tokens)) if max_tokens else None,
        "compute_imbalance": max(rank_cost) / mean_cost,
        "lockstep_imbalance": lockstep / mean_cost,
        "num_micro_batches": num_mb,
        "max_micro_batch_tokens": max(tokens),
        "total_cost": sum(rank_cost),
    }

