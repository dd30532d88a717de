"""transfer_queue: a streaming data plane and RL loop for LLM post-training on Ray."""

from pathlib import Path

from setuptools import find_packages, setup

CORE = [
    # torch is installed first, pinned, by `make setup` (torch==2.13.0, CPU build); any >= 2.5 works.
    "torch>=2.5",
    "ray[default]>=2.40",
    "tensordict>=0.10",
    "pyzmq>=26",
    "msgspec>=0.18",
    "numpy>=1.26",
    "tqdm>=4.60",
    "prometheus_client==0.26.0",  # /metrics of the controller and storage units (comes with ray[default] too)
]
RL = [
    "transformers>=4.50",
    "matplotlib>=3.8",
    "pyyaml>=6",
    "datasets==5.2.0",  # data.train_files / data.val_files: JSONL and Parquet rows (pyarrow comes with it)
]
AGENTS = [
    # the task server (workers/agents/task_server.py) and its clients; the sandbox needs bubblewrap (apt) too
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "httpx==0.28.1",
    "pydantic>=2",  # every request and response body of the task server and the OpenAI-compatible endpoint
]
TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.6",  # make test runs two workers (-n 2 --dist loadfile)
    "psutil>=5.9",  # the ray-job test stops exactly the head it started
    "hypothesis>=6.100",
    "openai==3.54.0",  # the OpenAI-compatible endpoint is tested with the real client
    "ruff>=0.6",
    "mypy>=1.10",
    "pre-commit>=3",
    "tensorboard==2.21.0",  # the optional TensorBoard metric sink is tested for real
]
LEDGER = [
    # the sampling control plane's ledger (workers/ledger): SQLAlchemy Core over SQLite or PostgreSQL (psycopg 3)
    "sqlalchemy==2.1.9",
    "psycopg[binary]==3.3.9",
    "pydantic>=2",
    "minio==7.2.20",  # the blob store's S3-compatible option (oss_connection_string)
]
LEDGER_TEST = ["moto[server]==5.2.5"]  # a real S3-compatible server on 127.0.0.1 for the blob store's tests
SMOLLM2 = ["gguf>=0.10", "accelerate>=1.0"]  # 0.5 MB of wheels; the slow tier's SmolLM2 tests need them

setup(
    name="transfer_queue",
    version="0.1.0",
    description="Streaming data plane (controller + storage units + zero-copy ZeroMQ client) and GRPO loop on Ray",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(
        include=[
            "transfer_queue",
            "transfer_queue.*",
            "rl_contracts",
            "rl_contracts.*",
            "workers",
            "workers.*",
            "trainers",
            "trainers.*",
            "orchestration",
            "orchestration.*",
        ]
    ),
    # the packages sit at the root: an editable install is then one .pth entry for it (setuptools' plain layout),
    # not an import finder that prints a warning box on every `pip install -e .`
    package_dir={"": "."},
    package_data={"transfer_queue": ["py.typed", "ops/static/*"]},
    install_requires=CORE,
    entry_points={"console_scripts": ["transfer-queue = transfer_queue.__main__:main"]},
    extras_require={
        "rl": RL,
        "agents": AGENTS,
        "ledger": LEDGER,
        "test": RL + AGENTS + LEDGER + TEST + LEDGER_TEST + SMOLLM2,
        "smollm2": RL + SMOLLM2,
    },
)
