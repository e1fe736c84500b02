"""From this rank's rollout samples to the micro-batches it runs.

Each dp rank keeps only the samples it trains on. Balancing needs only every sample's length (`Sample.row_len`:
the tokens it puts in a micro-batch row), so ranks all-gather (length, loss-token count) pairs, every rank
computes the same deterministic plan (packing.plan_micro_batches, starting from where each sample is), and the
samples whose planned rank differs from the rank that generated them move once, point to point
(ParallelDims.exchange_objects). Whole samples never pass through an all-gather.

Layouts: packed micro-batches under a token budget (balanced over dp by compute), or the padded
fixed-size baseline (`train.packing=false`). No-grad passes (old/reference logprobs, values) repack
each rank's samples where they are under the larger no-grad budget.
"""
from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import pickle
from typing import Sequence

from slime.config import TrainConfig
from slime.data.batch import MicroBatch, Positions, build_micro_batch, build_padded_micro_batch
from slime.data.packing import (Plan, Prompts, default_cost, pack_each_rank, packing_stats, padded_fixed_batches,
                                plan_micro_batches)
from slime.data.sample import Sample
from slime.distributed.parallel_dims import ParallelDims


class Layout:
    """How samples become micro-batches: packed under a token budget, or padded fixed-size.

    The balancing cost of a sample is `default_cost` at the model's hidden size plus `patch_cost` per
    image patch (the vision tower's work); `positions` gives a sample's position ids (mrope rows for
    image-text models); `share_prompts`: siblings of a prompt in one micro-batch carry it once (batch.py).
    """

    def __init__(self, *, packing: bool, max_tokens: int, micro_batch_size: int, hidden_size: int = 4096,
                 patch_cost: float = 0.0, positions: Positions | None = None, sp: int = 1, budget_key: str = "",
                 share_prompts: bool = False):
        # With sequence parallelism a micro-batch is cut over sp ranks: it holds up to sp x the per-GPU budget.
        self.packing, self.max_tokens, self.micro_batch_size = packing, max_tokens * sp, micro_batch_size
        self.cost_fn = functools.partial(default_cost, hidden_size=hidden_size)
        self.patch_cost, self.positions, self.sp = patch_cost, positions, sp
        self.per_gpu, self.budget_key = max_tokens, budget_key
        self.share_prompts = share_prompts

    @classmethod
    def for_training(cls, train: TrainConfig, **model_terms) -> "Layout":
        return cls(packing=train.packing, max_tokens=train.max_tokens_per_gpu, micro_batch_size=train.micro_batch_size,
                   budget_key="train.max_tokens_per_gpu", **model_terms)

    @classmethod
    def for_nograd(cls, train: TrainConfig, **model_terms) -> "Layout":
        """No-grad passes keep no activations for backward, so they get a larger budget."""
        return cls(packing=train.packing, max_tokens=train.logprob_max_tokens_per_gpu or 2 * train.max_tokens_per_gpu,
                   micro_batch_size=train.micro_batch_size, budget_key="train.logprob_max_tokens_per_gpu",
                   **model_terms)

    def check_lengths(self, lengths: Sequence[int]) -> None:
        """A sample longer than a micro-batch can hold fails here, with the settings that would fit it."""
        if not self.packing or not lengths or max(lengths) <= self.max_tokens:
            return
        n = max(lengths)
        need_sp = -(-n // self.per_gpu)
        raise ValueError(f"a sample of {n} tokens (its prompt and response less the last token, a target only) does "
                         f"not fit a micro-batch of parallel.sp={self.sp} x {self.budget_key}={self.per_gpu} = "
                         f"{self.max_tokens} tokens: raise {self.budget_key} to {-(-n // self.sp)}, or parallel.sp to "
                         f"{need_sp} or more (sequence parallelism cuts a sample over sp GPUs; sp must divide the "
                         "model's attention heads and the number of GPUs), or lower "
                         "rollout.max_response_len")

    def prompt_key(self, s: Sample) -> tuple[bytes, int] | None:
        """What packing needs of a sample's prompt to count it once per micro-batch, where this layout shares
        prompts (text samples only, as build_micro_batch): a digest of its ids (cheap to gather over ranks) and
        its length. None: the sample carries its own copy."""
        if not (self.packing and self.share_prompts) or s.mm is not None:
            return None
        return hashlib.blake2b(array.array("q", s.prompt_ids).tobytes(), digest_size=16).digest(), len(s.prompt_ids)

    def plan(self, lengths: Sequence[int], dp: int, owners: Sequence[int] | None = None,
             patches: Sequence[int] | None = None, prompts: Prompts | None = None) -> Plan:
        """Balanced over dp ranks; samples may change rank (as few as balance allows, given `owners`). A count
        that cannot give every rank the same number of non-empty micro-batches (not divisible by dp, as after
        dynamic sampling or a mini-batch split) gives the ranks short of samples dummy micro-batches."""
        self.check_lengths(lengths)
        if self.packing:
            extra = [self.patch_cost * n for n in patches] if patches is not None and self.patch_cost else None
            return plan_micro_batches(lengths, max_tokens=self.max_tokens, dp_size=dp, owners=owners,
                                      cost_fn=self.cost_fn, extra_cost=extra, allow_empty=True,
                                      prompts=prompts if self.share_prompts else None)
        return padded_fixed_batches(lengths, micro_batch_size=self.micro_batch_size, dp_size=dp, allow_empty=True,
                                    owners=owners)

    def pack_in_place(self, lengths_by_rank: Sequence[Sequence[int]],
                      prompts_by_rank: Sequence[Prompts] | None = None) -> Plan:
        """Every rank's samples stay where they are; equal micro-batch counts (empty ones are dummies)."""
        if self.packing:
            self.check_lengths([n for lengths in lengths_by_rank for n in lengths])
            return pack_each_rank(lengths_by_rank, max_tokens=self.max_tokens,
                                  prompts_by_rank=prompts_by_rank if self.share_prompts else None)
        return pack_each_rank(lengths_by_rank, micro_batch_size=self.micro_batch_size)

    def build(self, samples: Sequence[Sample], idx: list[int], dummy_fields: Sequence[str] = ()) -> MicroBatch:
        if self.packing:
            return build_micro_batch(samples, idx, self.positions, pad_to=self.sp, share_prompts=self.share_prompts,
                                     dummy_fields=dummy_fields)
        return build_padded_micro_batch(samples, idx, self.positions, dummy_fields=dummy_fields)

    def stats(self, lengths: Sequence[int], plan: Plan, prompts: Prompts | None = None) -> dict:
        st = packing_stats(lengths, plan, max_tokens=self.max_tokens if self.packing else None,
                           padded=not self.packing, cost_fn=self.cost_fn,
                           prompts=prompts if self.share_prompts else None, pad_to=self.sp if self.packing else 1)
        return {"real_token_fraction": st["real_token_fraction"], "dp_imbalance": st["compute_imbalance"]}


def prompts_unshared(train: TrainConfig, *, sp: int, multimodal: bool, moe: bool, attention: str) -> str | None:
    """Why a model's training rows do not share prompts (train.share_prompts), or None: they do. Shared prompts
    need packed_sdpa's prefix attention; image and MoE models keep their own copies (the router's per-token aux
    loss is weighted by input tokens, the vision tower runs per sample)."""
    from slime.models.attention import PACKED_SDPA

    return ("train.share_prompts=false" if not train.share_prompts
            else "train.packing=false" if not train.packing
            else f"parallel.sp={sp}" if sp > 1
            else "an image-text model" if multimodal
            else "a MoE model" if moe
            else f"{attention} attention, not {PACKED_SDPA}" if attention != PACKED_SDPA else None)


@dataclasses.dataclass
class MiniBatch:
    """One optimizer step's share of this rank."""
    micro: list[list[int]]
    """This rank's micro-batches: positions into RankBatch.samples."""
    num_loss_tokens: int
    """Loss tokens of the mini-batch over every rank: the global normaliser of token_mean."""
    num_seqs: int
    """Samples of the mini-batch with a loss token, over every rank: the global normaliser of the per-sequence
    modes (a sample with none, such as an all-observation turn, adds nothing to the loss and is not counted,
    as verl's seq_mask)."""
    num_processed: int
    """Tokens of the mini-batch's rows over every rank (each sample's `row_len`): weights per-token-of-input terms
    such as a MoE router's aux loss (its models keep their own prompt copies)."""
    stats: dict
    """Packing figures of the whole plan (the same on every rank)."""


@dataclasses.dataclass
class RankBatch:
    samples: list[Sample]
    """This rank's samples, in global-index order."""
    num_samples: int
    """Over every dp rank."""
    lengths_by_rank: list[list[int]]
    """Every dp rank's sample lengths (in its order), so any rank can plan in-place passes for all."""
    mini_batches: list[MiniBatch]
    moved: int
    """Samples that changed rank (over every rank)."""
    prompts_by_rank: list[list] | None = None
    """With shared prompts, every dp rank's Layout.prompt_key per sample (in its order), as lengths_by_rank."""


def distribute(local: list[Sample], dims: ParallelDims, layout: Layout, *, num_mini_batches: int = 1) -> RankBatch:
    """Collective over dp: plan the step's global batch from gathered lengths, move the samples that
    change rank, and return this rank's share with its micro-batch plan per mini-batch.

    The global batch is every rank's `local` list, rank after rank; `Sample.index` is set to the
    position in it. Mini-batch m is the contiguous index range [round(m N / M), round((m+1) N / M)) of the
    N samples and M mini-batches, whatever dp is (so dp does not change what an optimizer step sees); a rank
    short of samples in a mini-batch runs dummy micro-batches.
    """
    meta = dims.all_gather_objects([(s.row_len, s.num_loss_tokens, s.num_patches, layout.prompt_key(s))
                                    for s in local])
    offset = sum(len(m) for m in meta[:dims.dp_rank])
    for i, s in enumerate(local):
        s.index = offset + i
    lengths = [length for part in meta for length, _, _, _ in part]
    loss_tokens = [n for part in meta for _, n, _, _ in part]
    patches = [n for part in meta for _, _, n, _ in part]
    keys = [k for part in meta for _, _, _, k in part]
    prompts = keys if any(k is not None for k in keys) else None
    source = [r for r, part in enumerate(meta) for _ in part]
    n = len(lengths)
    if n < num_mini_batches:
        raise ValueError(f"the step's batch has {n} samples, fewer than train.num_mini_batches={num_mini_batches}: "
                         "lower train.num_mini_batches or raise rollout.batch_size")
    bounds = [round(m * n / num_mini_batches) for m in range(num_mini_batches + 1)]
    dest = [0] * n
    plans = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        plan = layout.plan(lengths[a:b], dims.dp, owners=source[a:b], patches=patches[a:b],
                           prompts=prompts[a:b] if prompts is not None else None)
        for rank, mbs in enumerate(plan):
            for mb in mbs:
                for i in mb:
                    dest[a + i] = rank
        plans.append(plan)

    me = dims.dp_rank
    outgoing: dict[int, list[Sample]] = {}
    for s in local:
        if dest[s.index] != me:
            outgoing.setdefault(dest[s.index], []).append(s)
    try:
        received = dims.exchange_objects(outgoing)
    except (TypeError, AttributeError, pickle.PicklingError) as e:  # before the collective: the others see it end
        raise TypeError(f"a sample cannot be pickled to move to the rank that trains it ({type(e).__name__}: {e}): "
                        "what a generate function or a reward puts in Sample.metadata must be plain data (numbers, "
                        "strings, lists, dicts), not a lock, a client or an open file") from e
    mine = sorted([s for s in local if dest[s.index] == me] + [s for part in received.values() for s in part],
                  key=lambda s: s.index)
    position = {s.index: k for k, s in enumerate(mine)}
    minis = []
    for (a, b), plan in zip(zip(bounds[:-1], bounds[1:]), plans):
        minis.append(MiniBatch(micro=[[position[a + i] for i in mb] for mb in plan[me]],
                               num_loss_tokens=sum(loss_tokens[a:b]), num_seqs=sum(n > 0 for n in loss_tokens[a:b]),
                               num_processed=sum(lengths[a:b]),
                               stats=layout.stats(lengths[a:b], plan, prompts[a:b] if prompts is not None else None)))
    by_rank: list[list[int]] = [[] for _ in range(dims.dp)]
    prompts_by_rank: list[list] | None = [[] for _ in range(dims.dp)] if prompts is not None else None
    for i in range(n):
        by_rank[dest[i]].append(lengths[i])
        if prompts_by_rank is not None:
            prompts_by_rank[dest[i]].append(prompts[i])
    moved = sum(d != s for d, s in zip(dest, source))
    return RankBatch(samples=mine, num_samples=n, lengths_by_rank=by_rank, prompts_by_rank=prompts_by_rank,
                     mini_batches=minis, moved=moved)
