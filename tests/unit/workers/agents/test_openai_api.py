"""The OpenAI-compatible endpoint, driven by the real ``openai`` client over 127.0.0.1: completions come back with
the sampled token ids and log-probs, and those ids are exactly what the model scores with those log-probs."""

from __future__ import annotations

import asyncio
import base64

import openai
import pytest
import torch

from workers.agents.openai_api import create_app
from workers.agents.samplers import BatchingSampler, engine_generate
from workers.agents.task_server import serve_in_background
from workers.agents.trajectory import PlainChatFormat
from workers.engines.base import SamplingParams
from workers.engines.hf import HFEngine
from workers.models import build_tiny_causal_lm

CHARS = "\n abcdefghijklmnopqrstuvwxyz:."
PAD, EOS, BASE = 0, 1, 2


def encode(text: str) -> list[int]:
    unknown = sorted(set(text) - set(CHARS))
    if unknown:
        raise ValueError(f"characters {unknown} are not in the vocabulary")
    return [BASE + CHARS.index(c) for c in text]


def decode(ids) -> str:
    return "".join(CHARS[i - BASE] if i >= BASE else "" for i in ids)


@pytest.fixture(scope="module")
def endpoint():
    model = build_tiny_causal_lm(BASE + len(CHARS), max_position_embeddings=128, seed=1)
    engine = HFEngine(model, pad_token_id=PAD, eos_token_id=EOS)
    app = create_app(BatchingSampler(engine_generate(engine)), PlainChatFormat(encode, decode), model="tiny")
    with serve_in_background(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), engine


def test_models_lists_the_policy(endpoint):
    client, _ = endpoint
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completions_return_the_sampled_ids_and_their_logprobs(endpoint):
    client, engine = endpoint
    messages = [{"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, n=3, max_tokens=6, temperature=1.0, logprobs=True, seed=7
    )
    prompt = encode("user: hi there\nassistant: ")
    assert out.model_extra["prompt_token_ids"] == prompt and out.model_extra["policy_version"] == 0
    assert len(out.choices) == 3 and out.usage.prompt_tokens == len(prompt)
    with torch.no_grad():
        for choice in out.choices:
            ids, lps = choice.model_extra["token_ids"], choice.model_extra["token_logprobs"]
            assert 1 <= len(ids) <= 6 and choice.finish_reason in ("stop", "length")
            assert choice.message.content == decode(ids)
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(lps)
            # the ids are the sampled ids: the model gives them exactly the log-probs the endpoint returned
            logits = engine.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            assert expected.tolist() == pytest.approx(lps, abs=1e-4)
    same = client.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=6, seed=7)
    assert [c.model_extra["token_ids"] for c in same.choices] == [c.model_extra["token_ids"] for c in out.choices]


def test_a_stop_string_cuts_the_completion_and_bad_requests_get_openai_errors(endpoint):
    client, _ = endpoint
    free = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=12, seed=3
    )
    text = free.choices[0].message.content
    # seed 3 makes the sample deterministic; it is long enough to cut (else pick another seed, never skip)
    assert len(text) >= 3, f"the tiny model ended after {text!r}; no room for a stop string"
    stop = text[1]
    cut = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=12, seed=3, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"characters \['\?', 'A'\] are not in the vocabulary"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A?"}])


def test_with_a_key_the_endpoint_refuses_a_client_without_it(endpoint):
    _, engine = endpoint
    app = create_app(
        BatchingSampler(engine_generate(engine)), PlainChatFormat(encode, decode), model="tiny", api_key="sk-run"
    )
    messages = [{"role": "user", "content": "hi"}]
    with serve_in_background(app) as url:
        for key in ("unused", "sk-run-not"):
            refused = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="missing or wrong API key") as error:
                refused.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
            assert error.value.status_code == 401 and error.value.body["type"] == "authentication_error"
            with pytest.raises(openai.AuthenticationError):
                refused.models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-run", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert len(client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices) == 1


def test_text_parts_are_joined_and_an_image_part_is_refused_by_a_text_engine(endpoint):
    client, _ = endpoint
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2, seed=1
    )
    assert out.model_extra["prompt_token_ids"] == encode("user: hi\nthere\nassistant: ")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(
        openai.BadRequestError,
        match=r"messages\[1\]\.content\[1\] is an image_url part, but model 'tiny' behind this endpoint takes text "
        r"only: expected string content or 'text' parts",
    ) as refused:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": "look"}, {"role": "user", "content": [parts[0], image]}],
            max_tokens=2,
        )
    assert refused.value.status_code == 400 and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="input_audio"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
        )


def test_a_vlm_endpoint_takes_image_parts_and_returns_the_ids_the_model_scores_with_those_images():
    from workers.engines.errors import ImagesNotSupported
    from workers.models import build_tiny_vlm
    from workers.vision import solid_png

    vlm = build_tiny_vlm()
    engine = HFEngine(vlm.model)
    app = create_app(BatchingSampler(engine_generate(engine)), vlm.chat, model="tiny-vlm")
    png = solid_png(8, 8, (255, 0, 0))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]
    with serve_in_background(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model="tiny-vlm", messages=[{"role": "user", "content": content}], n=2, max_tokens=4, seed=5
        )
        prompt = out.model_extra["prompt_token_ids"]
        assert prompt == vlm.chat.prompt([{"role": "user", "content": content}])[0]
        assert prompt.count(vlm.image_token_id) == vlm.tokens_per_image
        with torch.no_grad():
            for choice in out.choices:
                ids, lps = choice.model_extra["token_ids"], choice.model_extra["token_logprobs"]
                logits = engine.model(
                    input_ids=torch.tensor([prompt + ids]), pixel_values=vlm.image_processor([png])
                ).logits[0, len(prompt) - 1 : -1]
                expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                assert expected.tolist() == pytest.approx(lps, abs=1e-4)
        # an image the server cannot read is the client's error, with the part named
        remote = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
        with pytest.raises(openai.BadRequestError, match=r"images\[0\]: expected a base64 data URL") as refused:
            client.chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": remote}])
        assert refused.value.status_code == 400

    async def images_to_a_text_call():
        text_only = BatchingSampler(lambda prompts, params: (0, []))
        await text_only.sample([1], SamplingParams(max_new_tokens=1), images=[png])

    with pytest.raises(
        ImagesNotSupported, match=r"batched call '.*<lambda>' takes no images, but 1 came with the prompt"
    ):
        asyncio.run(images_to_a_text_call())
