"""Image-text samples: packed micro-batches with images equal each sample's own unpacked forward."""
import dataclasses
import functools
import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from conftest import REPO, run_ranks
from one_rank import OneRank
from data_tools.make_tiny_model import make_tiny_model
from slime.data.batch import build_micro_batch
from slime.data.sample import Sample
from slime.models.adapters import get_adapter
from slime.models.attention import PACKED_SDPA
from slime.models.policy import PolicyModel
from slime.multimodal.processor import VLProcessor
from slime.trainer.policy_engine import sample_positions


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl_model(request, tmp_path_factory):
    # A larger init than the default makes attention position-sensitive, so wrong rope rows show (see the control).
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, seed=1, init_std=0.1)


def image(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def vl_samples(model_dir, sizes=((60, 50), (120, 90), (40, 110)), text_only=1, seed=0):
    """Image-text samples with one image each of the given sizes, then text-only samples."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = VLProcessor(str(model_dir), tok)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k, size in enumerate(sizes):
        img = image(*size, seed + k)
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                     {"type": "text", "text": f"q{k}"}]}],
                                       add_generation_prompt=True, tokenize=False)
        ids = proc.prompt_ids(text, [img.size])
        mm = proc.pixels([img]).without_images()
        samples.append(Sample(prompt_ids=ids, response_ids=torch.randint(20, 250, (3 + k,), generator=g).tolist(),
                              mm=mm))
    for k in range(text_only):
        samples.append(Sample(prompt_ids=tok("<user>hello<assistant>", add_special_tokens=False).input_ids,
                              response_ids=torch.randint(20, 250, (4,), generator=g).tolist()))
    return samples


def alone_logprobs(model, s):
    """The reference: the plain HF model on one sample, positions from its own get_rope_index."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    kwargs = {}
    if s.mm is not None:
        mm_types = (ids == model.config.image_token_id).int()
        pos, _ = model.model.get_rope_index(ids, mm_types, image_grid_thw=s.mm.image_grid_thw)
        kwargs = dict(pixel_values=s.mm.pixel_values, image_grid_thw=s.mm.image_grid_thw, position_ids=pos,
                      mm_token_type_ids=mm_types)
    logits = model(input_ids=ids, **kwargs).logits[0].float()
    p = len(s.prompt_ids)
    return torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, ids[0, p:, None]).squeeze(-1)


def packed(model_dir):
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, attn_implementation={"text_config": PACKED_SDPA, "vision_config": "sdpa"})
    adapter = get_adapter(model.config.model_type)

    return PolicyModel(model, adapter=adapter), functools.partial(sample_positions, adapter, model)


def run(policy, mb, chunk=5):
    return policy(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=chunk,
                  target_ids=mb.target_ids, **mb.extra)


def test_packed_image_text_batch_equals_each_sample_alone(vl_model):
    policy, positions = packed(vl_model)
    alone = AutoModelForImageTextToText.from_pretrained(vl_model, attn_implementation="sdpa")
    samples = vl_samples(vl_model)
    grids = [tuple(s.mm.image_grid_thw[0].tolist()) for s in samples if s.mm is not None]
    assert len(set(grids)) == 3  # three different image sizes
    # Mixed order: a text-only sample between image-text ones.
    order = [0, 3, 1, 2]
    mb = build_micro_batch(samples, order, positions)
    assert mb.position_ids.shape == (3, mb.input_ids.numel()) and mb.extra["image_grid_thw"].shape == (3, 3)
    with torch.no_grad():
        logp, _ = run(policy, mb)
        for i, got in zip(order, mb.split(logp)):
            torch.testing.assert_close(got, alone_logprobs(alone, samples[i]), rtol=1e-5, atol=1e-5)


def test_controls_wrong_positions_or_a_shared_row_would_show(vl_model):
    """The equality above is a real check: 1-D positions instead of the mrope rows, or one attention span
    over the whole packed row, give clearly different logprobs."""
    policy, positions = packed(vl_model)
    alone = AutoModelForImageTextToText.from_pretrained(vl_model, attn_implementation="sdpa")
    samples = vl_samples(vl_model)
    mb = build_micro_batch(samples, [0, 3, 1, 2], positions)
    one_d = dataclasses.replace(mb, position_ids=mb.position_ids[0])
    leak = dataclasses.replace(mb, cu_seqlens=torch.tensor([0, mb.input_ids.numel()], dtype=torch.int32))
    with torch.no_grad():
        for wrong in (one_d, leak):
            logp, _ = run(policy, wrong)
            err = max((got - alone_logprobs(alone, samples[i])).abs().max().item()
                      for i, got in zip([0, 3, 1, 2], wrong.split(logp)))
            assert err > 1e-3


def test_packed_image_text_gradients_equal_per_sample(vl_model):
    policy, positions = packed(vl_model)
    alone = AutoModelForImageTextToText.from_pretrained(vl_model, attn_implementation="sdpa")
    samples = vl_samples(vl_model, seed=3)
    mb = build_micro_batch(samples, range(len(samples)), positions)
    logp, _ = run(policy, mb, chunk=4)
    logp.sum().backward()
    sum(alone_logprobs(alone, s).sum() for s in samples).backward()
    ref = dict(alone.named_parameters())
    for name, p in policy.hf.named_parameters():
        assert p.grad is not None, name
        # fp32 sums in another order; the larger init makes these gradients ~10x those of test_packed_logprobs
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_text_only_batch_still_runs_the_vision_tower(vl_model):
    """ZeRO-3 lockstep: the tower runs (on a dummy image) and gets a zero gradient, so its hooks fire."""
    policy, positions = packed(vl_model)
    samples = vl_samples(vl_model, sizes=(), text_only=2)
    mb = build_micro_batch(samples, [0, 1], positions)
    assert not mb.extra
    calls = []
    handle = policy.hf.model.visual.register_forward_hook(lambda *a: calls.append(1))
    logp, _ = run(policy, mb)
    logp.sum().backward()
    handle.remove()
    assert calls == [1]
    grads = [p.grad for p in policy.hf.model.visual.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
    # and the text-only logprobs are those of the model without any image
    alone = AutoModelForImageTextToText.from_pretrained(vl_model, attn_implementation="sdpa")
    with torch.no_grad():
        for s, got in zip(samples, mb.split(logp)):
            torch.testing.assert_close(got, alone_logprobs(alone, s), rtol=1e-5, atol=1e-5)


def test_two_rank_zero3_step_with_a_text_only_rank_matches_one_process(vl_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_ranks([str(REPO / "tests/dist/vl_checks.py"), str(vl_model), str(out)], timeout=600)
    result = json.loads((out / "result.json").read_text())
    assert result["tower_calls"] == [2, 2]  # one vision-tower call per micro-batch on both ranks
    alone = AutoModelForImageTextToText.from_pretrained(vl_model, attn_implementation="sdpa")
    samples = vl_samples(vl_model, text_only=3)
    n_tokens = sum(len(s.response_ids) for s in samples)
    loss = -sum(alone_logprobs(alone, s).sum() for s in samples) / n_tokens
    loss.backward()
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)
    grads = torch.load(out / "grads.pt")
    for name, p in alone.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_generated_image_placeholder_is_text(vl_model):
    """A response may contain the image placeholder token (a policy can sample it): it is an ordinary token,
    takes no image feature, and changes nothing before it."""
    policy, positions = packed(vl_model)
    s = vl_samples(vl_model, sizes=((60, 50),), text_only=0)[0]
    with_pad = dataclasses.replace(s, response_ids=s.response_ids[:2] + [s.mm.token_id] + s.response_ids[2:])
    mb = build_micro_batch([s, with_pad], [0, 1], positions)
    assert int(mb.extra["image_mask"].sum()) == 2 * s.prompt_ids.count(s.mm.token_id)
    with torch.no_grad():
        a, b = mb.split(run(policy, mb)[0])
    torch.testing.assert_close(a[:2], b[:2], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(b).all()


def test_sequence_parallel_cuts_after_the_image_features_are_merged(vl_model, tmp_path):
    """sp=2 on 2 ranks: rows with images are cut into shards after the embedding (features merged first), and
    each shard takes its slice of the three mrope rows; the logprobs are each sample's own."""
    run_ranks([str(REPO / "tests/dist/vl_checks.py"), str(vl_model), str(tmp_path), "sp"], timeout=600)
    result = torch.load(tmp_path / "sp.pt", weights_only=False)
    assert result["rows"]  # rows with images were cut
    alone = AutoModelForImageTextToText.from_pretrained(vl_model, attn_implementation="sdpa")
    samples = vl_samples(vl_model, text_only=1)
    with torch.no_grad():
        for s, got in zip(samples, result["logprobs"]):
            torch.testing.assert_close(got, alone_logprobs(alone, s), rtol=1e-5, atol=1e-5)


def test_a_seeded_image_text_generation_ignores_the_global_generator(vl_model, tmp_path):
    """One-step-off rollout samples in a thread while activation checkpointing saves and restores torch's global
    generator: with a seed, the image-text path (HF's generate) draws from its own, as the text path does, and its
    logprobs are those of the model on what it drew."""
    from slime.config import ModelConfig
    from slime.rollout.engine import SamplingParams
    from slime.rollout.hf_engine import HFEngine

    import shutil

    from transformers import GenerationConfig

    # An Instruct checkpoint's generation defaults (Qwen2-VL's): HF's generate would apply them to every option
    # left unset (near-greedy top_p, a repetition penalty); the engine's sampling must not take them.
    model_dir = shutil.copytree(vl_model, tmp_path / "instruct")
    GenerationConfig(do_sample=True, top_p=0.001, top_k=1, temperature=0.01, repetition_penalty=1.05).save_pretrained(
        model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(ModelConfig(path=str(model_dir), dtype="float32"), tok, device=torch.device("cpu"))
    samples = vl_samples(vl_model, text_only=0)[:2]
    prompts, mm = [s.prompt_ids for s in samples], [s.mm for s in samples]

    def draw(seed, global_seed):
        torch.manual_seed(global_seed)
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95, n=2,
                                                       ignore_eos=True, seed=seed), mm)
        return [g for group in gens for g in group]

    first = draw(seed=5, global_seed=0)
    assert len({tuple(g.response_ids) for g in first}) > 1  # sampled, not the checkpoint's near-greedy defaults
    assert [g.response_ids for g in draw(seed=5, global_seed=0)] != [g.response_ids for g in first]  # drawn on
    assert [g.response_ids for g in draw(seed=6, global_seed=0)] != [g.response_ids for g in first]
    assert [g.response_ids for g in draw(seed=5, global_seed=1)] == [g.response_ids for g in first]  # afresh
    unseeded = [g for group in engine.generate(prompts, SamplingParams(max_new_tokens=6, n=4, ignore_eos=True), mm)
                for g in group]
    assert len({tuple(g.response_ids) for g in unseeded}) > 1
    torch.manual_seed(2)
    again = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=4, ignore_eos=True), mm)
    torch.manual_seed(2)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=6, n=4, ignore_eos=True), mm) == again
    assert all(len(g.response_ids) == 6 and len(g.logprobs) == 6 for g in first)
    model = engine.model
    for k, g in enumerate(first):  # teacher-forced logprobs of the drawn tokens at T = 0.8
        s = samples[k // 2]
        ids = torch.tensor([s.prompt_ids + g.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=s.mm.pixel_values, image_grid_thw=s.mm.image_grid_thw,
                           mm_token_type_ids=(ids == model.config.image_token_id).int()).logits
        want = torch.log_softmax(logits[0, len(s.prompt_ids) - 1:-1].float() / 0.8, -1)
        want = want.gather(-1, torch.tensor(g.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(g.logprobs), want, rtol=1e-4, atol=1e-4)


def test_an_abort_cuts_an_image_text_generation_running(vl_model, monkeypatch):
    """The image-text path runs HF's generate, which ran to max_new_tokens after abort() (a one-step-off batch
    being stopped waited the whole batch out) and called the rows "length". It now ends after the step in which
    the abort came, "abort"; the next call runs in full."""
    from slime.config import ModelConfig
    from slime.rollout.engine import SamplingParams
    from slime.rollout.hf_engine import HFEngine, SeededSampling

    engine = HFEngine(ModelConfig(path=str(vl_model), dtype="float32"), AutoTokenizer.from_pretrained(vl_model),
                      device=torch.device("cpu"))
    samples = vl_samples(vl_model, text_only=0)[:2]
    prompts, mm = [s.prompt_ids for s in samples], [s.mm for s in samples]
    params = SamplingParams(max_new_tokens=20, n=2, ignore_eos=True)
    sample, calls = SeededSampling.__call__, []

    def sample_then_abort(self, *args):  # another thread aborts during the second step
        calls.append(1)
        if len(calls) == 2:
            engine.abort()
        return sample(self, *args)

    monkeypatch.setattr(SeededSampling, "__call__", sample_then_abort)
    gens = [g for group in engine.generate(prompts, params, mm) for g in group]
    assert [(len(g.response_ids), g.finish_reason) for g in gens] == [(2, "abort")] * 4 and len(calls) == 2
    monkeypatch.undo()
    gens = [g for group in engine.generate(prompts, params, mm) for g in group]
    assert [(len(g.response_ids), g.finish_reason) for g in gens] == [(20, "length")] * 4


def test_a_context_with_an_image_token_no_image_fills_is_refused_by_name(vl_model):
    """A multi-turn generate function that sends the model's own image token back as context: the image tokens
    outnumber what the images fill, which HF's rope index met with a bare StopIteration."""
    from slime.config import ModelConfig
    from slime.rollout.engine import SamplingParams
    from slime.rollout.hf_engine import HFEngine

    engine = HFEngine(ModelConfig(path=str(vl_model), dtype="float32"), AutoTokenizer.from_pretrained(vl_model),
                      device=torch.device("cpu"))
    first, second = vl_samples(vl_model, text_only=0)[:2]
    fills = first.prompt_ids.count(first.mm.token_id)
    assert first.mm.num_tokens == fills > 0
    context = first.prompt_ids + first.response_ids[:2] + [first.mm.token_id]  # the model generated an image token
    params = SamplingParams(max_new_tokens=2, n=1, temperature=0)
    with pytest.raises(ValueError, match=rf"prompt 1 of this generate call holds {fills + 1} image tokens .* its "
                                         rf"images fill {fills}: a multi-turn context"):
        engine.generate([second.prompt_ids, context], params, [second.mm, first.mm])
    assert len(engine.generate([context[:-1]], params, [first.mm])[0][0].response_ids) == 2


def vl_prompts(model_dir, n=2):
    """Image-text prompts as the data path makes them (a chat with one image each)."""
    from slime.data.prompts import Prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = VLProcessor(str(model_dir), tok)
    out = []
    for k in range(n):
        img = image(56 + 28 * k, 56, k)
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                     {"type": "text", "text": f"q{k}"}]}],
                                       add_generation_prompt=True, tokenize=False)
        out.append(Prompt(prompt_ids=proc.prompt_ids(text, [img.size]), prompt_text=text, label=None, metadata={},
                          index=k, source=f"vl.jsonl:{k + 1}", mm=proc.pixels([img])))
    return tok, out


def digit_fraction():
    from slime.rollout.rewards import make_reward_fn

    return make_reward_fn("e2e_rewards:digit_fraction")


@functools.lru_cache(maxsize=2)
def vl_engine(model_dir):
    from slime.config import ModelConfig
    from slime.rollout.hf_engine import HFEngine

    return HFEngine(ModelConfig(path=str(model_dir), dtype="float32"), AutoTokenizer.from_pretrained(model_dir),
                    device=torch.device("cpu"))


def test_a_sampled_image_token_ends_its_trajectory_not_the_run(vl_model):
    """A multi-turn generate function on image-text prompts: a turn in which the policy samples the image token
    (the random tiny model does, about once in 265 tokens) made the next turn's context one no engine can read,
    and the run stopped. The real engine, with a reply given that token: prompt 0's first turn, prompt 1's last."""
    from slime.rollout.engine import SamplingParams
    from slime.rollout.rollout import generate_rollout, rollout_metrics

    tok, prompts = vl_prompts(vl_model)
    engine, calls, image_token = vl_engine(vl_model), [], prompts[0].mm.token_id

    class SamplesTheImageToken:  # the real engine; calls 1 and 4 end in the image token
        thread_safe = False

        def generate(self, ids, params, mm=None):
            calls.append(list(ids[0]))
            out = engine.generate(ids, params, mm)
            if len(calls) in (1, 4):
                gen = out[0][0]
                gen.response_ids, gen.logprobs = gen.response_ids[:1] + [image_token], gen.logprobs[:1] + [-9.0]
            return out

    samples = generate_rollout(SamplesTheImageToken(), prompts, SamplingParams(max_new_tokens=16, n=1, temperature=0),
                               tok, digit_fraction(), first_group_id=0, generate_fn="custom_rollouts:three_turns")
    ended, last = samples
    observed = tok(" ok", add_special_tokens=False).input_ids
    assert ended.response_ids == ended.response_ids[:1] + [image_token] + observed * 2  # its first turn only
    assert ended.response_mask == [1, 1] + [0] * 2 * len(observed)
    assert ended.metadata["turns"] == 1 and ended.metadata["ended_at_image_token"]
    # the image token in the last turn cut nothing
    assert last.metadata["turns"] == 3 and "ended_at_image_token" not in last.metadata
    assert last.response_ids[-1] == image_token and len(calls) == 4  # nothing sent after an image token
    assert rollout_metrics(samples, OneRank())["rollout/image_token_ends"] == 1
    assert "rollout/image_token_ends" not in rollout_metrics([last], OneRank())
    # a function that loops while the trajectory has budget left ends: the refused turn says why, remaining is 0
    calls.clear()
    greedy = SamplingParams(max_new_tokens=16, n=1, temperature=0)
    first, second = generate_rollout(SamplesTheImageToken(), prompts, greedy, tok,
                                     digit_fraction(), first_group_id=0, generate_fn="custom_rollouts:loops_on_budget")
    assert first.metadata["reasons"] == ["length", "image_token"] and first.response_ids[-1] == image_token
    assert second.metadata["reasons"] == ["length"] * 3 + ["image_token"] and len(calls) == 4


def test_a_side_generation_on_a_text_context_goes_without_the_prompts_images(vl_model):
    """ctx.generate() on a context of the function's own (a judge's question) sent the prompt's images with it, and
    the engine refused the call (0 image tokens where the images fill 4)."""
    from slime.rollout.engine import SamplingParams
    from slime.rollout.rollout import generate_rollout

    tok, prompts = vl_prompts(vl_model, n=1)
    samples = generate_rollout(vl_engine(vl_model), prompts, SamplingParams(max_new_tokens=4, n=2, temperature=0),
                               tok, digit_fraction(), first_group_id=0,
                               generate_fn="custom_rollouts:asks_a_judge_in_text")
    assert len(samples) == 2 and all(len(s.metadata["judge"]) == 2 for s in samples)


def test_a_side_generation_on_a_context_of_its_own_with_the_image_tokens_sees_the_images(vl_model):
    """A judge's context that holds the prompt's image tokens after its own preface goes with the prompt's images
    (a first fix sent images only with contexts that start with the prompt: the judge ran without them, unsaid)."""
    from slime.rollout.engine import SamplingParams
    from slime.rollout.rollout import generate_rollout

    tok, prompts = vl_prompts(vl_model, n=1)
    engine = vl_engine(vl_model)
    greedy = SamplingParams(max_new_tokens=3, n=1, temperature=0)
    s, = generate_rollout(engine, prompts, greedy, tok, digit_fraction(), first_group_id=0,
                          generate_fn="custom_rollouts:asks_a_judge_about_the_image")
    want = engine.generate([s.metadata["judge_context"]], greedy, [prompts[0].mm])[0][0]
    assert s.metadata["judge"] == want.response_ids
    assert s.metadata["judge_logprobs"] == pytest.approx(want.logprobs, abs=1e-6)


def test_images_a_generate_function_gives_a_sample_are_refused(vl_model):
    """A sample's own Sample.mm (a tool's image) was replaced by the prompt's without a word."""
    from slime.rollout.engine import SamplingParams
    from slime.rollout.rollout import generate_rollout

    tok, prompts = vl_prompts(vl_model, n=1)
    with pytest.raises(ValueError, match=r"custom_rollouts:adds_an_image: a sample of the prompt at vl.jsonl:1 has "
                                         r"images of its own \(Sample.mm\): a sample's images are its prompt's"):
        generate_rollout(vl_engine(vl_model), prompts, SamplingParams(max_new_tokens=4, n=1, temperature=0), tok,
                         digit_fraction(), first_group_id=0, generate_fn="custom_rollouts:adds_an_image")
