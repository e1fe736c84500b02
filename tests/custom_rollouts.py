"""Generate functions for tests: a scripted environment that always answers once between two policy turns,
so every sample is multi-turn (the calculator example only is when the model calls it)."""
import dataclasses

from slime.rollout.custom import RolloutContext

OBSERVATION = " ok:"


def two_turns(ctx: RolloutContext):
    samples = []
    for k in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=3)
        traj.observe(ctx.tokenizer(OBSERVATION, add_special_tokens=False).input_ids)
        traj.generate(max_new_tokens=3)
        samples.append(traj.sample())
    return samples


async def two_turns_async(ctx: RolloutContext):
    return two_turns(ctx)


def graded_by_length(ctx: RolloutContext):
    """Gives its own reward: the sample's length (so the group is never constant)."""
    samples = []
    for k in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=1 + k)
        samples.append(traj.sample(reward=float(len(traj.response_ids))))
    return samples


def wrong_count(ctx: RolloutContext):
    return [ctx.trajectory().sample()]


def dicts(ctx: RolloutContext):
    return [{"response": "x"} for _ in range(ctx.n)]


class _AsyncCall:
    async def __call__(self, ctx: RolloutContext):
        return [ctx.trajectory().sample() for _ in range(ctx.n)]


async_object = _AsyncCall()  # inspect does not see its __call__ as a coroutine function


def infinite_reward(ctx: RolloutContext):
    samples = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2)
        samples.append(traj.sample(reward=float("inf")))
    return samples


def one_sample_repeated(ctx: RolloutContext):
    traj = ctx.trajectory()
    traj.generate(max_new_tokens=2)
    return [traj.sample()] * ctx.n


def _two_token_samples(ctx: RolloutContext, spoil) -> list:
    samples = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2)
        samples.append(traj.sample())
        spoil(samples[-1])
    return samples


def mask_of_fives(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "response_mask", [5] * len(s.response_ids)))


def masks_everything(ctx: RolloutContext):
    """Every response token an observation (mask 0): nothing for the policy to learn from."""
    return _two_token_samples(ctx, lambda s: setattr(s, "response_mask", [0] * len(s.response_ids)))


def text_reward(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "given_reward", "n/a"))


def grades_the_first_sample(ctx: RolloutContext):
    """Its own reward for the first sample of each group, none for the others."""
    out = []
    for k in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2)
        out.append(traj.sample(reward=0.5 if k == 0 else None))
    return out


def past_the_limit(ctx: RolloutContext):
    """Tokens added by hand past rollout.max_response_len (a trajectory stops at it)."""
    def extend(s):
        s.response_ids = s.response_ids + [5] * 8
        s.response_mask = [1] * len(s.response_ids)
        s.rollout_logprobs = [-0.5] * len(s.response_ids)
    return _two_token_samples(ctx, extend)


def float_ids(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "response_ids", [float(t) + 0.5 for t in s.response_ids]))


def nan_logprobs(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "rollout_logprobs", s.rollout_logprobs * float("nan")))


def other_prompt(ctx: RolloutContext):
    """The prompt tokenised again with more before it (a chat template applied twice, say)."""
    return _two_token_samples(ctx, lambda s: setattr(s, "prompt_ids", [1, 2, 3] + s.prompt_ids))


def no_prompt(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "prompt_ids", []))


def no_logprobs(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "rollout_logprobs", None))


def logprobs_2d(ctx: RolloutContext):
    """Logprobs kept (R, 1), as a gather(...) gives them."""
    return _two_token_samples(ctx, lambda s: setattr(s, "rollout_logprobs", s.rollout_logprobs[:, None]))


def numpy_and_tuple_ids(ctx: RolloutContext):
    """Token ids as numpy integers in a tuple (observe() takes such): taken, as a list of ints."""
    import numpy as np

    return _two_token_samples(ctx, lambda s: setattr(s, "response_ids", tuple(np.int64(t) for t in s.response_ids)))


def raises_on_the_second(ctx: RolloutContext):
    if ctx.prompt.index == 1:
        raise KeyError("tool")
    return _two_token_samples(ctx, lambda s: None)


def list_logprobs(ctx: RolloutContext):
    """Logprobs as a Python list (the Sample docstring asks for tensors): taken, as a tensor."""
    return _two_token_samples(ctx, lambda s: setattr(s, "rollout_logprobs", s.rollout_logprobs.tolist()))


def positive_logprobs(ctx: RolloutContext):
    return _two_token_samples(ctx, lambda s: setattr(s, "rollout_logprobs", s.rollout_logprobs.abs() + 5))


def hangs(ctx: RolloutContext):
    import threading

    threading.Event().wait()  # a tool that never answers


async def one_turn_async(ctx: RolloutContext):
    """Each of the n samples one turn, all of them (and every prompt's) at once: they queue for the engine."""
    import asyncio

    async def one():
        traj = ctx.trajectory()
        await traj.agenerate(max_new_tokens=2)
        return traj.sample(reward=0.0)

    return list(await asyncio.gather(*(one() for _ in range(ctx.n))))


async def hangs_async(ctx: RolloutContext):
    import asyncio

    await asyncio.Event().wait()


async def blocks_the_loop(ctx: RolloutContext):
    """One turn, then a blocking tool called directly from async code (requests.get, subprocess.run): it holds the
    event loop, so no asyncio timeout can fire."""
    import time

    traj = ctx.trajectory()
    await traj.agenerate(max_new_tokens=2)
    time.sleep(600)
    return [traj.sample(reward=0.0)]


async def tool_never_answers(ctx: RolloutContext):
    """One turn, then a blocking tool called the usual way from async code (asyncio.to_thread) that never returns."""
    import asyncio
    import threading

    traj = ctx.trajectory()
    await traj.agenerate(max_new_tokens=2)
    await asyncio.to_thread(threading.Event().wait)
    return [traj.sample(reward=0.0)]


def grades_the_first_prompt(ctx: RolloutContext):
    """Its own reward for every sample of prompt row 0, none for the other prompts' samples."""
    out = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2)
        out.append(traj.sample(reward=0.5 if ctx.prompt.index == 0 else None))
    return out


def tool_raises(ctx: RolloutContext):
    """A user error inside the function (a tool's output it did not expect)."""
    raise KeyError("missing")


def sets_reward_directly(ctx: RolloutContext):
    """Grades by setting Sample.reward, which the reward function's score replaced in silence."""
    samples = []
    for _ in range(ctx.params.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2)
        sample = traj.sample()
        sample.reward = 1.0
        samples.append(sample)
    return samples


def sampled_hint(ctx: RolloutContext):
    """A policy turn sampled at temperature 1 (no seed: torch's global generator), an observation, a greedy turn."""
    samples = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2, temperature=1.0)
        traj.observe(ctx.tokenizer(OBSERVATION, add_special_tokens=False).input_ids)
        traj.generate(max_new_tokens=2)
        samples.append(traj.sample())
    return samples


def three_turns(ctx: RolloutContext):
    """Three policy turns of 2 tokens with an observation between them (image-text prompts: the model's tests)."""
    samples = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        for turn in range(3):
            if turn:
                traj.observe(ctx.tokenizer(" ok", add_special_tokens=False).input_ids)
            traj.generate(max_new_tokens=2)
        samples.append(traj.sample())
    return samples


def asks_a_judge_in_text(ctx: RolloutContext):
    """A side generation on a text context of its own (a judge's question), then the policy's turn."""
    judge = ctx.generate(ctx.tokenizer("is it red?", add_special_tokens=False).input_ids, max_new_tokens=2)
    samples = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        traj.generate(max_new_tokens=2)
        samples.append(traj.sample(metadata={"judge": judge.response_ids}))
    return samples


def adds_an_image(ctx: RolloutContext):
    """Gives each sample images of its own (a tool's image), which the trainer would replace with the prompt's."""
    samples = two_turns(ctx)
    for s in samples:
        s.mm = dataclasses.replace(ctx.prompt.mm)
    return samples


def asks_a_judge_about_the_image(ctx: RolloutContext):
    """A side generation on a context of its own that holds the prompt's image tokens (a preface before them),
    given as an iterator."""
    context = ctx.tokenizer("judge:", add_special_tokens=False).input_ids + list(ctx.prompt.prompt_ids)
    judge = ctx.generate(iter(context), max_new_tokens=3)
    traj = ctx.trajectory()
    traj.generate(max_new_tokens=2)
    return [traj.sample(metadata={"judge": judge.response_ids, "judge_logprobs": judge.logprobs,
                                  "judge_context": context})]


def loops_on_budget(ctx: RolloutContext):
    """Policy turns while the trajectory has budget left (a loop that ends only on traj.remaining)."""
    samples = []
    for _ in range(ctx.n):
        traj, reasons = ctx.trajectory(), []
        while traj.remaining > 0 and len(reasons) < 50:
            reasons.append(traj.generate(max_new_tokens=2).finish_reason)
        samples.append(traj.sample(metadata={"reasons": reasons}))
    return samples
