"""Tiny causal language models built in-process from a config, for tests and toy tasks (no hub access)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_tiny_causal_lm(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 32,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    tie_word_embeddings: bool = True,
    attn_implementation: str = "eager",
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build a small randomly initialised ``LlamaForCausalLM`` from a config.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width; must be divisible by ``num_heads``.
        num_layers: number of decoder layers.
        num_heads: attention heads (no grouped-query attention).
        intermediate_size: MLP width; defaults to Llama's ``8/3 * hidden_size`` rounded up to a multiple of 8
            (hidden 64 gives 176 and about 100k parameters with 2 layers).
        max_position_embeddings: longest sequence the model is meant to see.
        pad_token_id, bos_token_id, eos_token_id: recorded in the config only.
        tie_word_embeddings: share the input embedding and the output head.
        attn_implementation: ``"eager"`` (default: about 20% faster than ``"sdpa"`` for a model this small on CPU)
            or ``"sdpa"``.
        seed: the weights are a pure function of the arguments and this seed.

    Returns:
        The model in float32, in train mode, on CPU.

    Raises:
        ValueError: if ``hidden_size`` is not divisible by ``num_heads``.

    >>> model = build_tiny_causal_lm(16)
    >>> sum(p.numel() for p in model.parameters()) < 200_000
    True
    """
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or _round_up(8 * hidden_size // 3, 8),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    config._attn_implementation = attn_implementation
    # Seed the global generator inside fork_rng, so that building a model leaves the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


#: ChatML, the chat template of :func:`save_tiny_chat_model`'s tokenizer (SmolLM2's and Qwen's layout)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")


def save_tiny_chat_model(
    path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, seed: int = 0
) -> Path:
    """Save a tiny random chat model as a normal Hugging Face directory at ``path`` (made if missing): a
    character-level tokenizer over printable ASCII and newline with a ChatML chat template
    (:data:`TINY_CHAT_TEMPLATE`; ``<|im_end|>`` is its eos), and a :func:`build_tiny_causal_lm` model for it. The
    directory loads with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` like any downloaded model; for
    tests and docs that need a ``model.path`` without a download. (vLLM's CPU attention refuses the default's head
    size, ``hidden_size / num_heads`` = 16: ``num_heads=2`` gives 32.)

    >>> from transformers import AutoTokenizer
    >>> import tempfile
    >>> tok = AutoTokenizer.from_pretrained(save_tiny_chat_model(tempfile.mkdtemp()))
    >>> tok.decode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
    ...     return_dict=False))
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_chat_tokenizer()
    tokenizer.save_pretrained(path)
    model = build_tiny_causal_lm(
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        seed=seed,
    )
    model.save_pretrained(path)
    return path


def build_tiny_chat_tokenizer(extra_special_tokens: tuple[str, ...] = ()) -> Any:
    """The tokenizer of :func:`save_tiny_chat_model`, built in process: character level over printable ASCII and
    newline, with the ChatML template (:data:`TINY_CHAT_TEMPLATE`); ``<|im_end|>`` is its eos. Each of
    ``extra_special_tokens`` (e.g. ``"<image>"``) is one more special token, with the next ids after the characters'.

    >>> tok = build_tiny_chat_tokenizer(("<image>",))
    >>> tok.encode("<image>a", add_special_tokens=False) == [len(tok) - 1, tok.convert_tokens_to_ids("a")]
    True
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    symbols = [*TINY_SPECIAL_TOKENS, "\n", *(chr(c) for c in range(32, 127))]
    # BPE without merges over single characters: every character is its own token
    core = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *extra_special_tokens]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


#: the image placeholder of :func:`build_tiny_vlm`'s tokenizer
TINY_IMAGE_TOKEN = "<image>"


@dataclass
class TinyVLM:
    """A tiny vision-language model and the pieces that feed it (see :func:`build_tiny_vlm`).

    Attributes:
        model: a ``LlavaForConditionalGeneration`` (CLIP vision tower, 2-layer MLP projector, Llama text model).
        tokenizer: :func:`build_tiny_chat_tokenizer` with ``<image>`` as its last id, ``image_token_id``.
        image_processor: resize to the vision tower's ``image_size`` and CLIP-normalise.
        chat: renders messages with ``image_url`` parts to prompt ids (``<image>`` expanded to
            ``tokens_per_image`` copies) and their images.
        image_token_id: the model's ``config.image_token_index``.
        tokens_per_image: placeholder tokens per image (the vision tower's patch count).
    """

    model: Any
    tokenizer: Any
    image_processor: Any
    chat: Any
    image_token_id: int
    tokens_per_image: int


def build_tiny_vlm(
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_hidden_size: int = 32,
    vision_layers: int = 2,
    image_size: int = 16,
    patch_size: int = 4,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> TinyVLM:
    """Build a small randomly initialised LLaVA (``transformers.LlavaForConditionalGeneration``) from a config, with
    its tokenizer, image processor and chat format; no download.

    The text model is a :func:`build_tiny_causal_lm`-sized Llama over :func:`build_tiny_chat_tokenizer` with
    ``<image>`` (vocabulary: 101 ids, ``<image>`` = 100 = ``config.image_token_index``); the vision tower a CLIP
    encoder over ``image_size`` x ``image_size`` images in ``patch_size`` patches, whose patch features (the CLS
    token dropped: ``vision_feature_select_strategy="default"``, last layer) the projector maps into the text
    model's embeddings, one per placeholder token: ``(image_size // patch_size) ** 2`` per image (16 by default).
    About 150k parameters; builds in tens of milliseconds.

    Args:
        hidden_size, num_layers: the text model's width and depth (4 heads).
        vision_hidden_size, vision_layers: the vision tower's width and depth (4 heads).
        image_size, patch_size: the vision tower's input size and patch size.
        max_position_embeddings: the longest prompt + response.
        seed: the weights are a pure function of the arguments and this seed.

    Returns:
        A :class:`TinyVLM`; the model in float32, train mode, on CPU.

    >>> vlm = build_tiny_vlm()
    >>> vlm.tokens_per_image, vlm.image_token_id, type(vlm.model).__name__
    (16, 100, 'LlavaForConditionalGeneration')
    """
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from workers.agents.trajectory import HFChatFormat
    from workers.vision import ImageProcessor, VisionChatFormat, tokens_per_image

    tokenizer = build_tiny_chat_tokenizer((TINY_IMAGE_TOKEN,))
    image_token_id = tokenizer.convert_tokens_to_ids(TINY_IMAGE_TOKEN)
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=_round_up(8 * hidden_size // 3, 8),
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision_config = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden_size,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).float()
    per_image = tokens_per_image(model)
    chat = VisionChatFormat(HFChatFormat(tokenizer), TINY_IMAGE_TOKEN, image_token_id, per_image)
    return TinyVLM(model, tokenizer, ImageProcessor.for_model(model), chat, image_token_id, per_image)
