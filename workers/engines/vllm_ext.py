"""Methods vLLM adds to each of its workers (``LLM(worker_extension_cls=...)``), called with ``collective_rpc``.

They run inside vLLM's engine-core process, next to the model, so new weights go from the caller to the model
through vLLM's own RPC (a state dict) or as a directory path (the worker reads the files itself). Kept apart from
``vllm_engine.py`` and free of top-level vLLM imports: vLLM imports this module by name in its worker process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def iter_checkpoint(path: str | Path) -> Any:
    """``(name, tensor)`` pairs of a Hugging Face directory's weights (safetensors, else ``pytorch_model*.bin``)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            yield from load_file(str(file)).items()
        return
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def encode_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensors as ``(dtype, shape, raw bytes)``: vLLM's RPC to its workers carries bytes, not tensors."""
    encoded = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        encoded[name] = (str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes())
    return encoded


def decode_state_dict(encoded: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (dtype, shape, raw) in encoded.items():
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out[name] = flat.view(getattr(torch, dtype)).reshape(shape)
    return out


def with_tied_head(weights: Any, tied: bool) -> Any:
    """``weights`` plus ``lm_head.weight`` = the input embedding when the model ties them and the checkpoint leaves
    the head out (as ``save_pretrained`` does). vLLM's in-place reload (0.32, CPU) un-ties the two: a checkpoint
    without the head would leave the old head in place (seen here: log-probs off by up to 1 nat after a reload)."""
    embedding, head_seen = None, False
    for name, tensor in weights:
        if name == "lm_head.weight":
            head_seen = True
        elif name.endswith("embed_tokens.weight"):
            embedding = tensor
        yield name, tensor
    if tied and not head_seen and embedding is not None:
        yield "lm_head.weight", embedding


class WeightSyncExtension:
    """Mixed into vLLM's worker class: ``self.model_runner`` is the worker's model runner."""

    def tq_load_weights(self, encoded: dict[str, Any]) -> int:
        """Copy a Hugging Face-named state dict (``encode_state_dict``) into the model; returns its tensor count."""
        state_dict = decode_state_dict(encoded)
        # vLLM's in-place reload: it undoes and redoes the kernel-format processing (CPU weight repacking), which a
        # bare model.load_weights after the first load would not
        self.reload_weights(weights_iterator=with_tied_head(iter(state_dict.items()), self._tq_tied()))  # type: ignore[attr-defined]
        return len(state_dict)

    def tq_load_weights_from_dir(self, path: str) -> int:
        """Load a Hugging Face directory's weights into the model; returns the number of tensors read."""
        count = 0

        def counted() -> Any:
            nonlocal count
            for item in iter_checkpoint(path):
                count += 1
                yield item

        self.reload_weights(weights_iterator=with_tied_head(counted(), self._tq_tied()))  # type: ignore[attr-defined]
        return count

    def _tq_tied(self) -> bool:
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        return bool(getattr(hf_config, "tie_word_embeddings", False))

    def tq_weight_checksum(self) -> float:
        """The sum of every parameter (a cheap check that an update landed)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return float(sum(p.detach().double().sum() for p in model.parameters()))
