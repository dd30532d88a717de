"""HFEngine: batched sampling with a Hugging Face causal LM and a small KV-cached decoding loop."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from workers.engines.base import (
    AbortCheck,
    Engine,
    Generation,
    SamplingParams,
    check_prompts,
    check_version,
    check_weight_update,
)
from workers.engines.errors import ImagesNotSupported, ImageTokenMismatch

# from_pretrained builds the model under a process-wide meta-device context: two loads in two threads at once
# (weight syncs to several engines of one process) break each other, so loads are serialised.
_LOAD_LOCK = threading.Lock()


def _load_pretrained(path: str, dtype: torch.dtype) -> PreTrainedModel:
    """A causal LM, or a vision-language model (a config with a ``vision_config``: ``AutoModelForImageTextToText``)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with _LOAD_LOCK:
        if getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None:
            return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _placed(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """``model`` on ``device`` in ``dtype``, in eval mode. ``nn.Module.to`` is the call ``model.to`` makes; transformers
    wraps ``PreTrainedModel.to`` in a decorator whose typing reads as an unbound method."""
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval()


class HFEngine(Engine):
    """Sample responses with a Hugging Face causal LM, on CPU or one GPU.

    Prompts are left-padded into one batch (each repeated ``n`` times) and decoded together, at most
    ``max_batch_size`` rows at a time. A response that produces the eos token or one of
    ``params.stop_token_ids`` ends there: the stop token is the last entry of ``token_ids`` (with its log-prob,
    because the policy chose it and the trainer must credit it) and ``finish_reason`` is ``"stop"``; a response
    that reaches ``max_new_tokens`` has ``finish_reason`` ``"length"``.

    A hand-written KV-cached loop is used rather than ``model.generate``: it was as fast for the tiny model (256
    prompts x 4 tokens: 28 ms vs 27 ms on one CPU thread), returns the sampled tokens' log-probs directly and
    samples from a private ``torch.Generator``, so a seeded call is reproducible and leaves the global RNG alone.

    The engine owns ``model``: it moves it to ``device``/``dtype``, puts it in eval mode and overwrites its weights
    in ``update_weights``. Pass a copy if the trainer keeps training the original.

    Args:
        model: a causal LM; exactly one of ``model`` and ``model_path``.
        model_path: a Hugging Face model directory, loaded with ``AutoModelForCausalLM.from_pretrained``
            (``AutoModelForImageTextToText`` for a vision-language model's).
        device: where the model runs.
        dtype: parameter dtype; log-probs are always computed in float32.
        pad_token_id: used to left-pad prompts; defaults to the model config's.
        eos_token_id: always a stop token; defaults to the model config's.
        max_batch_size: the most rows (prompts x n) decoded in one forward pass.
        image_processor: for a vision-language model (a LLaVA-style one, with ``config.vision_config`` and an image
            token id), turns a prompt's images into ``pixel_values``; defaults to ``workers.vision.ImageProcessor``
            for the model's vision tower.

    Vision-language models: ``generate(..., images=...)`` takes each prompt's images (bytes, a base64 ``data:``
    URL, a PIL image or a ``[3, H, W]`` tensor in [0, 1]); a prompt holds ``workers.vision.tokens_per_image(model)``
    image tokens per image, in the images' order (``workers.vision.VisionChatFormat.prompt`` renders such prompts
    from OpenAI content parts). The pixel values go into the first forward pass only (the prompt's); the decoding
    loop, the log-probs and the finish reasons are the text path's.

    >>> from workers.models import build_tiny_causal_lm
    >>> engine = HFEngine(build_tiny_causal_lm(16), pad_token_id=0, eos_token_id=2)
    >>> [[generation]] = engine.generate([[1, 5, 6]], n=1, params=SamplingParams(max_new_tokens=3, seed=0))
    >>> len(generation.token_ids) == len(generation.logprobs) <= 3
    True
    """

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        *,
        model_path: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        max_batch_size: int = 256,
        image_processor: Callable[[Sequence[Any]], torch.Tensor] | None = None,
    ) -> None:
        if (model is None) == (model_path is None):
            raise ValueError(
                f"give exactly one of model and model_path, got model={type(model).__name__}, model_path={model_path!r}"
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if model is None:
            assert model_path is not None  # exactly one of the two, checked above
            model = _load_pretrained(model_path, dtype)
        self._device = torch.device(device)
        self._dtype = dtype
        self._model = _placed(model, self._device, dtype)
        self.pad_token_id = _token_id_or_config(pad_token_id, self._model, "pad_token_id")
        self.eos_token_id = _token_id_or_config(eos_token_id, self._model, "eos_token_id")
        self.max_batch_size = max_batch_size
        self._image_processor = image_processor
        self._version = 0

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    @property
    def version(self) -> int:
        return self._version

    supports_abort = True

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        should_abort: AbortCheck | None = None,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n`` responses per prompt; see ``Engine.generate``.

        ``should_abort`` is polled after every decoding step; once it returns True, every unfinished response is
        returned as it stands with ``finish_reason="abort"`` (rows of later batches come back empty).

        ``images``: for a vision-language model, one list of images per prompt (empty for a text-only prompt); see
        the class docstring.

        Raises:
            ValueError: if ``n < 1``, a prompt is empty or holds an id outside the vocabulary, or a prompt plus
                ``max_new_tokens`` is longer than the model's ``max_position_embeddings``, or ``images`` does not
                have one entry per prompt.
            ImagesNotSupported: if images are given to a model that takes text only.
            ImageTokenMismatch: if a prompt's image tokens are not ``tokens_per_image`` per image.
        """
        self._check_prompts(prompts, n, params)
        pixels = self._pixel_values(prompts, images)
        rows = [prompt for prompt in prompts for _ in range(n)]
        row_pixels = [p for p in pixels for _ in range(n)]
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        stop_ids = torch.tensor(sorted({self.eos_token_id, *params.stop_token_ids}), device=self._device)
        banned = self._banned_token()
        generations: list[Generation] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            if should_abort is not None and generations and should_abort():
                generations.extend(Generation([], [], "abort") for _ in chunk)
                continue
            chunk_pixels = [p for p in row_pixels[start : start + self.max_batch_size] if p is not None]
            pixel_values = torch.cat(chunk_pixels).to(self._device, self._dtype) if chunk_pixels else None
            generations.extend(
                self._generate_chunk(chunk, params, stop_ids, generator, should_abort, pixel_values, banned)
            )
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_chunk(
        self,
        rows: list[list[int]],
        params: SamplingParams,
        stop_ids: torch.Tensor,
        generator: torch.Generator | None,
        should_abort: AbortCheck | None = None,
        pixel_values: torch.Tensor | None = None,
        banned: int | None = None,
    ) -> list[Generation]:
        input_ids, attention_mask = self._left_pad(rows)
        # the images go into the prompt's pass only: later steps read their features from the KV cache
        images = {} if pixel_values is None else {"pixel_values": pixel_values}
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        cache_keyword = _cache_keyword(self._model)  # once per call, not per decoded token
        finished = torch.zeros(len(rows), dtype=torch.bool, device=self._device)
        tokens, logprobs = [], []
        aborted = False
        for step in range(params.max_new_tokens):
            out = self._model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{cache_keyword: cache},
                use_cache=True,
                logits_to_keep=1,
                **(images if step == 0 else {}),
            )
            token, logprob = _sample(out.logits[:, -1, :].float(), params, generator, banned)
            # Rows that already stopped keep decoding (the batch moves together); their tokens are dropped below.
            tokens.append(token)
            logprobs.append(logprob)
            finished |= torch.isin(token, stop_ids)
            if step + 1 == params.max_new_tokens or bool(finished.all()):
                break
            if should_abort is not None and should_abort():
                aborted = True
                break
            input_ids = token[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
        return _to_generations(torch.stack(tokens, 1), torch.stack(logprobs, 1), stop_ids, aborted)

    def _banned_token(self) -> int | None:
        """A vision-language model's image placeholder token: never sampled. It stands for an image's features only
        where the prompt puts it; one in a response would be embedded as a word here, but taken for an image slot
        (with no image) by the trainer's pass over prompt + response. None for a text model."""
        from workers.vision import image_token_id

        return image_token_id(self._model)

    def _pixel_values(
        self, prompts: list[list[int]], images: Sequence[Sequence[Any]] | None
    ) -> list[torch.Tensor | None]:
        """Each prompt's ``pixel_values`` (None without images), after checking its image tokens."""
        from workers.vision import ImageProcessor, image_token_id, tokens_per_image

        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images must hold one list per prompt: {len(prompts)} prompts, got {len(images)} lists")
        token_id = image_token_id(self._model)
        if token_id is None:
            if images is not None and any(images):
                raise ImagesNotSupported(
                    f"{type(self._model).__name__} takes text only (no vision config and image token), but images "
                    f"were given for {sum(1 for i in images if i)} prompts; expected a vision-language model"
                )
            return [None] * len(prompts)
        if self._image_processor is None:
            self._image_processor = ImageProcessor.for_model(self._model)
        per_image = tokens_per_image(self._model)
        out: list[torch.Tensor | None] = []
        for i, prompt in enumerate(prompts):
            given = list(images[i]) if images is not None else []
            found = prompt.count(token_id)
            if found != per_image * len(given):
                raise ImageTokenMismatch(
                    f"prompt {i} holds {found} image tokens (id {token_id}) for {len(given)} images; expected "
                    f"{per_image} per image: {per_image * len(given)}"
                )
            out.append(self._image_processor(given) if given else None)
        return out

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, length - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, length - len(row) :] = 1
        return input_ids.to(self._device), attention_mask.to(self._device)

    def _check_prompts(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        max_positions = getattr(_text_config(self._model), "max_position_embeddings", None)
        embeddings = self._model.get_input_embeddings()
        check_prompts(
            prompts,
            n,
            params,
            vocab_size=embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None,
            max_len=None if max_positions is None else ("max_position_embeddings", max_positions),
        )

    def update_weights(
        self, version: int, state_dict: dict[str, torch.Tensor] | None = None, path: str | None = None
    ) -> None:
        """Load new weights and set ``version``; see ``Engine.update_weights``.

        A state dict must hold exactly the model's keys with the model's shapes; a key whose tensor is tied to
        another (``lm_head.weight`` with tied embeddings) may be left out. Values are copied (and cast) into the
        existing parameters. A directory replaces the model with ``from_pretrained(path)``.

        Raises:
            ValueError: if not exactly one of ``state_dict`` and ``path`` is given, ``version`` is lower than the
                current one, or the state dict's keys or shapes do not match the model's.
        """
        check_weight_update(self._version, version, state_dict, path)
        if state_dict is not None:
            self._check_state_dict(state_dict)
            with torch.no_grad():
                self._model.load_state_dict(state_dict, strict=False)
        else:
            assert path is not None  # check_weight_update: exactly one of state_dict and path
            self._model = _placed(_load_pretrained(path, self._dtype), self._device, self._dtype)
        self._version = version

    def update_weights_in_place(self, fill: Callable[[dict[str, torch.Tensor]], int]) -> int:
        """Let ``fill`` write new weights straight into the model's parameters and buffers (its ``state_dict()``,
        which shares their storage; e.g. ``WeightChannel.read_into``) and return their version, which becomes the
        engine's. Returns it.

        Raises:
            ValueError: if the version ``fill`` returns is lower than the current one (the weights are then already
                overwritten; a channel's versions never go back, so only a mixed use of sources can get there).
        """
        with torch.no_grad():
            version = fill(self._model.state_dict())
        check_version(self._version, version)
        self._version = version
        return version

    def _check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        expected = self._model.state_dict()
        seen_storage, tied = set(), set()
        for name, tensor in expected.items():
            if tensor.data_ptr() in seen_storage:
                tied.add(name)
            seen_storage.add(tensor.data_ptr())
        missing = sorted(set(expected) - set(state_dict) - tied)
        unexpected = sorted(set(state_dict) - set(expected))
        mismatched = [
            f"{name}: expected {tuple(expected[name].shape)}, got {tuple(tensor.shape)}"
            for name, tensor in state_dict.items()
            if name in expected and tuple(tensor.shape) != tuple(expected[name].shape)
        ]
        problems = [
            f"{label} ({len(items)}): {items[:5]}{' ...' if len(items) > 5 else ''}"
            for label, items in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("shape mismatch", mismatched),
            )
            if items
        ]
        if problems:
            raise ValueError(f"state_dict does not fit {type(self._model).__name__}: " + "; ".join(problems))

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "version": self._version,
            "device": str(self._device),
            "dtype": str(self._dtype).removeprefix("torch."),
            "model": type(self._model).__name__,
            "num_parameters": sum(p.numel() for p in self._model.parameters()),
            "max_batch_size": self.max_batch_size,
        }


def _token_id_or_config(token_id: int | None, model: PreTrainedModel, name: str) -> int:
    if token_id is None:
        token_id = getattr(model.config, name, None)
        if token_id is None:
            token_id = getattr(_text_config(model), name, None)
        if isinstance(token_id, list):
            token_id = token_id[0]
    if token_id is None:
        raise ValueError(f"{name} is not given and the model config has none; pass {name}=...")
    return int(token_id)


def _text_config(model: PreTrainedModel) -> Any:
    """The config of a model's language part: ``config.get_text_config()`` (the config itself for a text model; a
    vision-language model's ``text_config``, which holds its token ids and positions)."""
    get = getattr(model.config, "get_text_config", None)
    return get() if callable(get) else model.config


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, banned: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row, never ``banned``; return it and its log-prob under ``log_softmax(logits /
    temperature)`` (the full distribution: ``banned`` is left out of the choice as top-k leaves tokens out)."""
    if params.temperature == 0:
        token = _without(logits, banned).argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    sampling_logits = _truncate(_without(scaled, banned), params.top_k, params.top_p)
    probs = torch.softmax(sampling_logits, dim=-1)
    token = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


def _without(logits: torch.Tensor, banned: int | None) -> torch.Tensor:
    """``logits`` with the ``banned`` column at -inf (a new tensor; ``logits`` itself without one)."""
    if banned is None:
        return logits
    out = logits.clone()
    out[:, banned] = float("-inf")
    return out


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask all but the top-k tokens and the top-p nucleus with -inf (the most likely token always survives)."""
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _to_generations(
    tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: torch.Tensor, aborted: bool = False
) -> list[Generation]:
    is_stop = torch.isin(tokens, stop_ids)
    # Length up to and including the first stop token, else the full width.
    has_stop = is_stop.any(dim=1)
    first_stop = is_stop.int().argmax(dim=1)
    lengths = torch.where(has_stop, first_stop + 1, tokens.shape[1]).tolist()
    token_rows, logprob_rows = tokens.cpu().tolist(), logprobs.cpu().tolist()
    return [
        Generation(
            token_ids=token_rows[i][:length],
            logprobs=logprob_rows[i][:length],
            finish_reason="stop" if stop else ("abort" if aborted else "length"),
        )
        for i, (length, stop) in enumerate(zip(lengths, has_stop.tolist(), strict=True))
    ]


def _cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``forward`` takes its KV cache by: ``cache`` since transformers 5.24 (``past_key_values`` still
    works there but warns on every call), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
