"""Tiny causal language models built in-process from a config, for tests and toy tasks (no hub access)."""

from __future__ import annotations

from pathlib import Path

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


def save_tiny_chat_model(path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """Save a tiny random chat model as a normal Hugging Face directory at ``path`` (made if missing): a
    character-level tokenizer over printable ASCII and newline with a ChatML chat template
    (:data:`TINY_CHAT_TEMPLATE`; ``<|im_end|>`` is its eos), and a :func:`build_tiny_causal_lm` model for it. The
    directory loads with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` like any downloaded model; for
    tests and docs that need a ``model.path`` without a download.

    >>> from transformers import AutoTokenizer
    >>> import tempfile
    >>> tok = AutoTokenizer.from_pretrained(save_tiny_chat_model(tempfile.mkdtemp()))
    >>> tok.decode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
    ...     return_dict=False))
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    symbols = [*TINY_SPECIAL_TOKENS, "\n", *(chr(c) for c in range(32, 127))]
    # BPE without merges over single characters: every character is its own token
    core = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    model = build_tiny_causal_lm(
        len(symbols),
        hidden_size=hidden_size,
        num_layers=num_layers,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        seed=seed,
    )
    model.save_pretrained(path)
    return path
