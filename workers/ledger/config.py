"""``SamplingConfig``: the sampling control plane's settings, with AgentRL's names (``target_concurrency``,
``max_concurrent_samples_per_process``, ``num_generations``, ``max_new_tokens``, ``max_prompt_tokens``,
``sync_sampling``, ``db_connection_string``, ``oss_connection_string``) and the sizing of the run's inference
services (``inf_tp_size``, ``inf_ep_size``, ``inf_mem_ratio``), which a run hands to its ``InferenceManager``
(``InferenceManager.from_config(cfg, "sglang", model_path, dp_size=2, ledger=ledger)``, workers/engines/manager.py;
it refuses what its engine cannot honour). A setting it does not know is refused (``InvalidSamplingConfig``, naming
the closest valid names). A recipe's own settings (AgentRL's ``AgentTrainingConfig`` carries e.g. ``train_file``) go
in a subclass::

    class OSWorldConfig(SamplingConfig):
        train_file: str = "assets/osworld_dataset.jsonl"

>>> cfg = SamplingConfig(output_dir="/tmp/run")
>>> cfg.ledger_url
'sqlite:////tmp/run/ledger.db'
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workers.ledger.errors import InvalidSamplingConfig
from workers.ledger.schema import parse_connection_string


class SamplingConfig(BaseModel):
    """The sampling control plane's settings (see the module docstring).

    Raises:
        InvalidSamplingConfig: a setting it does not know (a subclass declares a recipe's own), or settings that
            contradict each other.
    """

    # a refused value is never echoed (a connection string's password); the errors name what was wrong instead.
    # Unknown keys never reach pydantic's extra="forbid": _known_settings_only refuses them first, with a typed error
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    output_dir: str = Field("output/sampling", description="the run's directory: the SQLite ledger and blobs go here")
    db_connection_string: str | None = Field(
        None,
        repr=False,  # it may hold a password
        description="'sqlite:///PATH' or 'postgresql://USER@HOST:PORT/DB'; default: output_dir/ledger.db",
    )
    oss_connection_string: str | None = Field(
        None,
        repr=False,  # it may hold a secret key
        description="blob store: None (output_dir/blobs), a directory, or 'http(s)://KEY:SECRET@HOST:PORT/BUCKET'",
    )
    split: str = Field("train", description="the split samplers claim from when none is given")
    num_epochs: int = Field(1, ge=1, description="epochs the scheduler writes and samples before it stops")
    target_concurrency: int = Field(8, ge=1, description="in-flight requests per healthy inference service aimed at")
    max_concurrent_samples_per_process: int = Field(8, ge=1, description="sampler coroutines one process runs at once")
    num_generations: int = Field(1, ge=1, description="samples per task (a GRPO group)")
    max_new_tokens: int = Field(256, ge=1, description="completion length asked of the inference service")
    max_prompt_tokens: int = Field(1024, ge=1, description="longest prompt a sampler may send (longer: the task fails)")
    sync_sampling: bool = Field(
        False, description="True: epoch e+1 is written only when every task of epoch e has finished"
    )
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    model: str = Field("policy", description="the model name inference services register under")
    lease_s: float = Field(60.0, gt=0, description="a claim's lease; heartbeats renew it every heartbeat_s")
    heartbeat_s: float = Field(10.0, gt=0, description="how often a sampler renews its claim; < lease_s")
    max_attempts: int = Field(3, ge=1, description="claims a task gets before it is marked failed")
    service_stale_s: float = Field(30.0, gt=0, description="services silent this long are marked down")
    request_timeout_s: float = Field(300.0, gt=0, description="one chat completion request's timeout")
    # AgentRL's guide sizes the inference services with these; InferenceManager.from_config puts them on the engine's
    # command line (vLLM --tensor-parallel-size, --enable-expert-parallel, --gpu-memory-utilization; SGLang
    # --tp-size, --ep-size, --mem-fraction-static) and refuses what the engine cannot honour
    inf_tp_size: int = Field(1, ge=1, description="tensor-parallel size of each inference service (devices each)")
    inf_ep_size: int = Field(1, ge=1, description="expert-parallel size of each inference service")
    inf_mem_ratio: float | None = Field(
        None, gt=0, le=1, description="fraction of each device's memory an inference service takes; None: the engine's"
    )

    @model_validator(mode="before")
    @classmethod
    def _known_settings_only(cls, data: Any) -> Any:
        # not a ValueError: pydantic would fold it into a ValidationError, and a typed error is what callers catch
        if isinstance(data, dict):
            refusals = [_refusal(cls, str(key)) for key in data if key not in cls.model_fields]
            if refusals:
                raise InvalidSamplingConfig("; ".join(sorted(refusals)))
        return data

    @field_validator("db_connection_string")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_connection_string(value)
        return value

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> SamplingConfig:
        # not a ValueError: pydantic would fold it into a ValidationError, and a typed error is what callers catch
        if self.heartbeat_s >= self.lease_s:
            raise InvalidSamplingConfig(
                f"heartbeat_s: expected < lease_s = {self.lease_s} (a claim is renewed every heartbeat_s and lapses "
                f"lease_s after its last renewal), got heartbeat_s = {self.heartbeat_s}"
            )
        return self

    @property
    def ledger_url(self) -> str:
        """``db_connection_string``, or the SQLite file under ``output_dir``."""
        if self.db_connection_string is not None:
            return self.db_connection_string
        return f"sqlite:///{os.path.abspath(os.path.join(self.output_dir, 'ledger.db'))}"


def _refusal(cls: type[SamplingConfig], key: str) -> str:
    """Why ``key`` is refused: a name ``cls`` does not have, with the closest ones it has (its value is never shown:
    it may be a secret)."""
    valid = sorted(cls.model_fields)
    by_lower = {name.lower(): name for name in valid}
    close = [by_lower[m] for m in difflib.get_close_matches(key.lower(), list(by_lower), n=3, cutoff=0.6)]
    hint = f"did you mean {', '.join(close)}?" if close else f"expected one of {valid}"
    return (
        f"unknown {cls.__name__} setting {key!r}; {hint} (a recipe's own settings go in a subclass: "
        f"class MyConfig(SamplingConfig): train_file: str)"
    )
