"""workers.vision: images to tensors and pixel values, a VLM's image tokens, and prompts from OpenAI content parts;
workers.models.build_tiny_vlm, the tiny LLaVA they are tested on."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from workers.engines.errors import ImagesNotSupported, ImageTokenMismatch
from workers.ledger.errors import UnknownContentPart, UnsupportedImageType
from workers.models import build_tiny_causal_lm, build_tiny_vlm
from workers.vision import (
    CLIP_MEAN,
    CLIP_STD,
    ImageProcessor,
    image_tensor,
    image_token_id,
    solid_png,
    tokens_per_image,
)

RED = (255, 0, 0)


def image_part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_every_image_source_decodes_to_the_same_rgb_tensor():
    png = solid_png(3, 2, RED)
    expected = torch.zeros(3, 2, 3)
    expected[0] = 1.0
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    for source in (png, url, Image.open(io.BytesIO(png)), expected.clone()):
        assert torch.equal(image_tensor(source), expected)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (b"not an image", r"images\[0\]: expected a PNG, JPEG, GIF or WebP image"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, r"images\[0\]: expected a decodable image, got 48 bytes that do not"),
        ("https://example.com/x.png", r"images\[0\]: expected a base64 data URL .* got 'https://example.com/x.png'"),
        (torch.zeros(1, 4, 4), r"images\[0\]: expected a \[3, H, W\] image tensor, got shape \(1, 4, 4\)"),
        (3, r"images\[0\]: expected image bytes, a base64 data: URL, a PIL image or a \[3, H, W\] tensor, got int"),
    ],
)
def test_an_unreadable_image_is_a_typed_error(source, match):
    with pytest.raises(UnsupportedImageType, match=match):
        ImageProcessor(4)([source])


def test_the_processor_resizes_and_normalises():
    pixels = ImageProcessor(4)([solid_png(10, 6, RED), torch.zeros(3, 4, 4)])
    assert pixels.shape == (2, 3, 4, 4)
    red = [(1.0 - CLIP_MEAN[0]) / CLIP_STD[0], -CLIP_MEAN[1] / CLIP_STD[1], -CLIP_MEAN[2] / CLIP_STD[2]]
    assert pixels[0].mean(dim=(1, 2)).tolist() == pytest.approx(red, abs=1e-5)
    assert pixels[1, :, 0, 0].tolist() == pytest.approx(
        [-m / s for m, s in zip(CLIP_MEAN, CLIP_STD, strict=True)], abs=1e-6
    )


def test_the_tiny_vlm_is_a_llava_whose_placeholders_match_its_vision_tower():
    vlm = build_tiny_vlm()
    assert type(vlm.model).__name__ == "LlavaForConditionalGeneration"
    assert image_token_id(vlm.model) == vlm.image_token_id == len(vlm.tokenizer) - 1 == 100
    assert tokens_per_image(vlm.model) == vlm.tokens_per_image == (16 // 4) ** 2
    assert vlm.image_processor == ImageProcessor(16)
    ids, images = vlm.chat.prompt([{"role": "user", "content": [image_part(solid_png(8, 8, RED))]}])
    with torch.no_grad():  # the forward accepts exactly tokens_per_image placeholders per image
        logits = vlm.model(input_ids=torch.tensor([ids]), pixel_values=vlm.image_processor(images)).logits
    assert logits.shape == (1, len(ids), 101)
    other = build_tiny_vlm(seed=1).model.state_dict()
    assert any(not torch.equal(v, other[k]) for k, v in vlm.model.state_dict().items())


def test_a_text_model_has_no_image_token_and_no_processor():
    model = build_tiny_causal_lm(16)
    assert image_token_id(model) is None
    with pytest.raises(ImagesNotSupported, match="LlamaForCausalLM has no vision config: it takes text only"):
        tokens_per_image(model)
    with pytest.raises(ImagesNotSupported, match=r"LlamaForCausalLM has no vision tower .*: it takes text only"):
        ImageProcessor.for_model(model)


def test_the_chat_format_expands_each_image_into_its_placeholders_in_order():
    vlm = build_tiny_vlm()
    first, second = solid_png(8, 8, RED), solid_png(4, 4, (0, 0, 255))
    messages = [
        {"role": "system", "content": "look"},
        {"role": "user", "content": [image_part(first), {"type": "text", "text": "and"}, image_part(second)]},
    ]
    ids, images = vlm.chat.prompt(messages)
    assert images == [first, second]
    text = vlm.tokenizer.decode(ids)
    block = "<image>" * vlm.tokens_per_image
    user = f"<|im_start|>user\n{block}\nand\n{block}<|im_end|>\n"
    assert text == f"<|im_start|>system\nlook<|im_end|>\n{user}<|im_start|>assistant\n"
    with pytest.raises(ImagesNotSupported, match="prompt_ids returns token ids only and would drop the 2 images"):
        vlm.chat.prompt_ids(messages)
    assert vlm.chat.prompt_ids([{"role": "user", "content": "hi"}]) == vlm.chat.chat.prompt_ids(
        [{"role": "user", "content": "hi"}]
    )


def test_the_chat_format_refuses_stored_refs_and_unknown_parts_and_missing_placeholders():
    vlm = build_tiny_vlm()
    ref = {"type": "image_ref", "blob": "ab", "mime": "image/png"}
    with pytest.raises(UnknownContentPart, match=r"messages\[0\]\.content\[0\]: .* got type 'image_ref' \(turn stored"):
        vlm.chat.prompt([{"role": "user", "content": [ref]}])
    with pytest.raises(UnknownContentPart, match=r"messages\[0\]\.content\[0\]: .* got type 'audio'"):
        vlm.chat.prompt([{"role": "user", "content": [{"type": "audio"}]}])
    # a template that drops the content loses the placeholder: said, not sampled without the image
    vlm.chat.chat.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(
        ImageTokenMismatch, match=r"the rendered prompt holds 0 image tokens \(id 100, text '<image>'\)"
    ):
        vlm.chat.prompt([{"role": "user", "content": [image_part(solid_png(2, 2, RED))]}])


def test_the_blob_image_source_reads_stored_images_and_names_a_missing_key():
    from workers.ledger.blobs import MemoryBlobStore
    from workers.ledger.errors import ImageNotFound
    from workers.vision import BlobImageSource, ImageProcessor, solid_png

    blobs = MemoryBlobStore()
    red, blue = solid_png(8, 8, (255, 0, 0)), solid_png(8, 8, (0, 0, 255))
    keys = [blobs.put(red, ".png"), blobs.put(blue, ".png")]
    assert blobs.put(red, ".png") == keys[0]  # content-addressed: stored once
    processor = ImageProcessor(4)
    assert torch.equal(BlobImageSource(blobs, processor).pixel_values(keys), processor([red, blue]))
    with pytest.raises(ImageNotFound, match=r"image_refs key 'ab/nope.png' \(image 1\) is not in the blob store"):
        BlobImageSource(blobs, processor).pixel_values([keys[0], "ab/nope.png"])
