"""HFEngine and SamplingParams: shapes, finish reasons, log-probs, determinism and weight updates."""

import copy
import warnings

import pytest
import torch

from trainers.fsdp import token_logprobs
from trainers.grpo import logprob_temperature
from workers.engines import Engine, HFEngine, SamplingParams
from workers.models import build_tiny_causal_lm

VOCAB, PAD, EOS = 16, 0, 2
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 3], [1, 4, 4, 4]]


def make_engine(seed: int = 0, **kwargs) -> HFEngine:
    return HFEngine(build_tiny_causal_lm(VOCAB, seed=seed), pad_token_id=PAD, eos_token_id=EOS, **kwargs)


@pytest.fixture
def engine():
    return make_engine()


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scaled = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / (temperature or 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def assert_same_generations(got: list, expected: list) -> None:
    """Same tokens and finish reasons; log-probs equal up to float noise (e.g. eager vs sdpa attention)."""
    assert len(got) == len(expected)
    for group_a, group_b in zip(got, expected, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": 4, "temperature": -0.5}, r"temperature must be >= 0 \(0 means greedy\), got -0.5"),
        ({"max_new_tokens": 4, "top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"max_new_tokens": 4, "top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"max_new_tokens": 4, "top_k": -1}, "top_k must be >= 0 \\(0 disables it\\), got -1"),
        (
            {"max_new_tokens": 4, "stop_token_ids": [3, -1]},
            r"stop_token_ids must be non-negative token ids, got \[3, -1\]",
        ),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_store_stop_ids_as_a_tuple():
    assert SamplingParams(max_new_tokens=2, stop_token_ids=[5, 6]).stop_token_ids == (5, 6)


def test_generate_returns_n_generations_per_prompt(engine):
    assert isinstance(engine, Engine)
    out = engine.generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=6, seed=0))
    assert len(out) == len(PROMPTS)
    for group in out:
        assert len(group) == 4
        for generation in group:
            assert 1 <= len(generation.token_ids) == len(generation.logprobs) <= 6
            assert all(0 <= token < VOCAB for token in generation.token_ids)
            assert all(logprob <= 0 for logprob in generation.logprobs)


def test_finish_reasons_and_nothing_after_a_stop_token(engine):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    [[free]] = engine.generate(PROMPTS[:1], n=1, params=greedy)
    # greedy decoding of the seeded model is deterministic: it runs to max_new_tokens (if a new torch or model
    # builder changes that, pick another seed for the fixture; the test must not turn into a skip)
    assert free.finish_reason == "length" and len(free.token_ids) == 8, free
    stop_token = free.token_ids[3]
    cut = free.token_ids.index(stop_token) + 1
    stopped = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop_token,))
    [[generation]] = engine.generate(PROMPTS[:1], n=1, params=stopped)
    assert generation.finish_reason == "stop"
    assert generation.token_ids == free.token_ids[:cut]
    assert generation.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)


def test_stop_invariants_with_sampling(engine):
    stop_ids = {EOS, 3, 4, 5, 6}
    params = SamplingParams(max_new_tokens=5, stop_token_ids=(3, 4, 5, 6), seed=0)
    generations = [g for group in engine.generate(PROMPTS, n=16, params=params) for g in group]
    assert {g.finish_reason for g in generations} == {"stop", "length"}
    for g in generations:
        assert not stop_ids & set(g.token_ids[:-1])
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in stop_ids
        else:
            assert len(g.token_ids) == 5 and g.token_ids[-1] not in stop_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, seed=2),
        SamplingParams(max_new_tokens=8, temperature=1.3, top_p=0.8, seed=3),
        SamplingParams(max_new_tokens=8, temperature=0.0),
    ],
    ids=["t1", "t0.7-topk", "t1.3-topp", "greedy"],
)
def test_logprobs_match_a_teacher_forced_forward_pass(engine, params):
    # Prompts of different lengths, so left padding and position ids are exercised.
    out = engine.generate(PROMPTS, n=3, params=params)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for g in group:
            expected = teacher_forced_logprobs(engine.model, prompt, g.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=1e-5, rtol=0)


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=6, temperature=0.0))
    top1 = engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=6, top_k=1, seed=0))
    for [g], group in zip(greedy, top1, strict=True):
        assert all(sample.token_ids == g.token_ids for sample in group)


def test_seed_makes_generation_deterministic_without_touching_the_global_rng(engine):
    params = SamplingParams(max_new_tokens=6, seed=123)
    rng_state = torch.get_rng_state()
    first = engine.generate(PROMPTS, n=4, params=params)
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert engine.generate(PROMPTS, n=4, params=params) == first
    assert engine.generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=6, seed=124)) != first


def test_chunking_by_max_batch_size_gives_the_same_greedy_result():
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    whole = make_engine().generate(PROMPTS, n=3, params=params)
    chunked = make_engine(max_batch_size=2).generate(PROMPTS, n=3, params=params)
    assert_same_generations(chunked, whole)


def test_update_weights_from_a_state_dict_changes_outputs_and_bumps_version(engine):
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(PROMPTS, n=1, params=params)
    other = build_tiny_causal_lm(VOCAB, seed=1)
    engine.update_weights(1, state_dict=other.state_dict())
    assert engine.version == 1 and engine.health()["version"] == 1
    after = engine.generate(PROMPTS, n=1, params=params)
    assert after != before
    assert_same_generations(after, make_engine(seed=1).generate(PROMPTS, n=1, params=params))


def test_update_weights_accepts_a_state_dict_without_the_tied_head(engine):
    state_dict = build_tiny_causal_lm(VOCAB, seed=1).state_dict()
    del state_dict["lm_head.weight"]
    engine.update_weights(1, state_dict=state_dict)
    assert torch.equal(engine.model.lm_head.weight, state_dict["model.embed_tokens.weight"])


def test_update_weights_in_place_from_a_weight_channel_generates_as_the_published_model(engine, tmp_path):
    from rl_contracts.weight_channel import WeightChannel

    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    channel = WeightChannel(tmp_path)
    channel.write(2, build_tiny_causal_lm(VOCAB, seed=1).state_dict())
    assert engine.update_weights_in_place(lambda targets: channel.read_into(targets).version) == 2
    assert engine.version == 2
    assert_same_generations(engine.generate(PROMPTS, n=1, params=params),
                            make_engine(seed=1).generate(PROMPTS, n=1, params=params))  # fmt: skip
    with pytest.raises(ValueError, match="version must not go backwards: current version=2, got 1"):
        engine.update_weights_in_place(lambda targets: 1)


def test_update_weights_from_a_directory(engine, tmp_path):
    build_tiny_causal_lm(VOCAB, seed=1).save_pretrained(tmp_path)
    engine.update_weights(3, path=str(tmp_path))
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert engine.version == 3
    assert_same_generations(
        engine.generate(PROMPTS, n=1, params=params), make_engine(seed=1).generate(PROMPTS, n=1, params=params)
    )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda sd: sd.pop("model.norm.weight"), r"missing keys \(1\): \['model.norm.weight'\]"),
        (lambda sd: sd.update(extra=torch.zeros(1)), r"unexpected keys \(1\): \['extra'\]"),
        (
            lambda sd: sd.update({"model.norm.weight": torch.zeros(32)}),
            r"shape mismatch \(1\): \['model.norm.weight: expected \(64,\), got \(32,\)'\]",
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_update_weights_rejects_a_state_dict_that_does_not_fit(engine, edit, match):
    state_dict = dict(build_tiny_causal_lm(VOCAB, seed=1).state_dict())
    edit(state_dict)
    with pytest.raises(ValueError, match="state_dict does not fit LlamaForCausalLM: " + match):
        engine.update_weights(1, state_dict=state_dict)
    assert engine.version == 0


def test_update_weights_argument_errors(engine):
    state_dict = engine.model.state_dict()
    with pytest.raises(ValueError, match="give exactly one of state_dict and path"):
        engine.update_weights(1)
    with pytest.raises(ValueError, match="give exactly one of state_dict and path"):
        engine.update_weights(1, state_dict=state_dict, path="/nowhere")
    engine.update_weights(5, state_dict=state_dict)
    with pytest.raises(ValueError, match="version must not go backwards: current version=5, got 4"):
        engine.update_weights(4, state_dict=state_dict)


@pytest.mark.parametrize(
    ("prompts", "n", "max_new_tokens", "match"),
    [
        ([[1, 2]], 0, 4, "n must be >= 1, got 0"),
        ([[1, 2], []], 1, 4, "prompt 1 is empty"),
        ([[1, 16]], 1, 4, r"prompt 0 holds a token id outside \[0, 16\): \[1, 16\]"),
        ([[1] * 30], 1, 4, "prompt 0 has 30 tokens; with max_new_tokens=4 that exceeds max_position_embeddings=32"),
    ],
)
def test_generate_validates_prompts(engine, prompts, n, max_new_tokens, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, n=n, params=SamplingParams(max_new_tokens=max_new_tokens))


def test_constructor_validation():
    with pytest.raises(ValueError, match="give exactly one of model and model_path"):
        HFEngine(pad_token_id=PAD, eos_token_id=EOS)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        make_engine(max_batch_size=0)
    with pytest.raises(ValueError, match="pad_token_id is not given and the model config has none"):
        HFEngine(build_tiny_causal_lm(VOCAB), eos_token_id=EOS)


def test_health(engine):
    health = engine.health()
    assert health["ok"] is True
    assert health["version"] == 0 and health["device"] == "cpu"
    assert health["model"] == "LlamaForCausalLM" and health["num_parameters"] > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, temperature=0.7, top_k=3, seed=4),
        SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.6, seed=5),
        SamplingParams(max_new_tokens=8, temperature=0.0),
    ],
    ids=["top-k", "top-p", "greedy"],
)
def test_the_trainer_scores_sampled_tokens_under_the_engines_distribution(engine, params):
    # The engine samples from the truncated distribution but reports log-probs of the full tempered one; the
    # trainer scores the same tokens the same way (at temperature 1 for greedy): the ratio starts at exactly 1.
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, n=2, params=params), strict=True):
        for g in group:
            ids = torch.tensor([prompt + g.token_ids])
            with torch.no_grad():
                logits = engine.model(ids).logits
            trainer = token_logprobs(logits, ids, torch.ones_like(ids), logprob_temperature(params.temperature))
            torch.testing.assert_close(trainer[0, len(prompt) :], torch.tensor(g.logprobs), atol=1e-5, rtol=0)


def test_generation_warns_nothing(engine):  # transformers 5.24 warned of past_key_values on every decoding step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=4, seed=0))


# --- vision-language models: images in, the text path's tokens and log-probs out ---------------------------------


def vlm_prompts():
    """Two prompts of different lengths (left padding), with one and two images of different sizes."""
    from workers.models import build_tiny_vlm
    from workers.vision import solid_png

    vlm = build_tiny_vlm()
    one = [{"type": "image_url", "image_url": {"url": solid_png(8, 8, (255, 0, 0))}}, {"type": "text", "text": "hue?"}]
    two = [
        {"type": "text", "text": "same?"},
        {"type": "image_url", "image_url": {"url": solid_png(20, 10, (0, 0, 255))}},
        {"type": "image_url", "image_url": {"url": solid_png(4, 4, (0, 255, 0))}},
    ]
    prompts = [vlm.chat.prompt([{"role": "user", "content": content}]) for content in (one, two)]
    return vlm, [ids for ids, _ in prompts], [images for _, images in prompts]


def test_a_vlm_samples_from_images_with_the_log_probs_of_a_teacher_forced_pass():
    vlm, prompts, images = vlm_prompts()
    engine = HFEngine(copy.deepcopy(vlm.model))
    params = SamplingParams(max_new_tokens=5, temperature=0.8, seed=0)
    groups = engine.generate(prompts, n=2, params=params, images=images)
    assert [len(group) for group in groups] == [2, 2]
    model = vlm.model.eval()
    for prompt, prompt_images, group in zip(prompts, images, groups, strict=True):
        for generation in group:
            assert len(generation.token_ids) == len(generation.logprobs) >= 1
            ids = torch.tensor([prompt + generation.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids, pixel_values=vlm.image_processor(prompt_images)).logits[0].float()
            scaled = logits[len(prompt) - 1 : -1] / params.temperature
            expected = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(generation.token_ids)[:, None])
            assert generation.logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-5)
    # the images matter: other images, other log-probs for the same tokens
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    [[with_red]] = engine.generate(prompts[:1], n=1, params=greedy, images=images[:1])
    from workers.vision import solid_png

    [[with_white]] = engine.generate(prompts[:1], n=1, params=greedy, images=[[solid_png(8, 8, (255, 255, 255))]])
    assert with_red.logprobs[0] != pytest.approx(with_white.logprobs[0], abs=1e-6)


def test_a_vlm_never_samples_its_image_token_and_the_trainer_pass_scores_what_it_sampled():
    """A response holding the image placeholder would make the trainer's pass over prompt + response count one image
    slot too many (LLaVA's forward refuses it); the engine leaves the token out of the choice, as top-k leaves
    tokens out, and reports the full distribution's log-probs, which the trainer's pass gives back."""
    from trainers.fsdp import model_token_logprobs
    from trainers.grpo import pad_sequences

    vlm, prompts, images = vlm_prompts()
    model = copy.deepcopy(vlm.model).eval()
    # the image token as the most likely next token by far, at every position
    model.lm_head.register_forward_hook(lambda module, args, out: out + 20.0 * (torch.arange(out.shape[-1]) == 100))
    engine = HFEngine(model)
    for params in (SamplingParams(max_new_tokens=4, temperature=1.0, seed=0), SamplingParams(max_new_tokens=4)):
        groups = engine.generate(prompts, n=2, params=params, images=images)
        rows = [(prompt, imgs, g) for prompt, imgs, group in zip(prompts, images, groups, strict=True) for g in group]
        eos = vlm.tokenizer.eos_token_id  # an unseeded sample may stop early (2 of 30 global seeds did)
        assert all(len(g.token_ids) == 4 or g.token_ids[-1] == eos for _, _, g in rows)
        assert all(vlm.image_token_id not in g.token_ids for _, _, g in rows)
        for prompt, prompt_images, generation in rows:
            batch = pad_sequences([prompt], [generation.token_ids], vlm.tokenizer.pad_token_id)
            pixels = vlm.image_processor(prompt_images)[None]
            with torch.no_grad():
                scored = model_token_logprobs(model, batch["input_ids"], batch["attention_mask"], pixel_values=pixels)
            expected = scored[batch["response_mask"] > 0].tolist()
            assert generation.logprobs == pytest.approx(expected, abs=1e-5)
            assert max(generation.logprobs) < -10  # the image token held nearly all of the full distribution


def test_images_for_a_text_model_or_placeholders_without_images_are_typed_errors():
    from workers.engines.errors import ImagesNotSupported, ImageTokenMismatch

    text_engine = make_engine()
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(
        ImagesNotSupported, match=r"LlamaForCausalLM takes text only .* images were given for 1 prompts"
    ):
        text_engine.generate([[1, 5]], n=1, params=params, images=[[b"\x89PNG\r\n\x1a\n"]])
    assert len(text_engine.generate([[1, 5]], n=1, params=params, images=[[]])[0]) == 1  # no image: no error

    vlm, prompts, images = vlm_prompts()
    engine = HFEngine(vlm.model)
    with pytest.raises(
        ImageTokenMismatch, match=r"prompt 1 holds 32 image tokens \(id 100\) for 1 images; expected 16"
    ):
        engine.generate(prompts, n=1, params=params, images=[images[0], images[1][:1]])
    with pytest.raises(ImageTokenMismatch, match=r"prompt 0 holds 16 image tokens \(id 100\) for 0 images"):
        engine.generate(prompts[:1], n=1, params=params)
    with pytest.raises(ValueError, match="images must hold one list per prompt: 2 prompts, got 1 lists"):
        engine.generate(prompts, n=1, params=params, images=images[:1])


def test_a_vlm_loads_from_a_directory_and_samples_as_the_model_it_was_saved_from(tmp_path):
    vlm, prompts, images = vlm_prompts()
    vlm.model.save_pretrained(tmp_path / "vlm")
    params = SamplingParams(max_new_tokens=4, seed=3)
    expected = HFEngine(copy.deepcopy(vlm.model)).generate(prompts, n=2, params=params, images=images)
    loaded = HFEngine(model_path=str(tmp_path / "vlm"))
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert_same_generations(loaded.generate(prompts, n=2, params=params, images=images), expected)
