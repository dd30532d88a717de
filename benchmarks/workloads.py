"""The workloads by name (see metadata_workloads.py, payload_workloads.py, wake_latency.py, auth_cost.py,
journal_cost.py, shm_workload.py and gpu_workload.py)."""

from auth_cost import bench_auth
from gpu_workload import bench_gpu
from journal_cost import bench_journal
from metadata_workloads import bench_concurrent, bench_get_meta, bench_get_meta_state
from payload_workloads import bench_grpo, bench_large, bench_small
from shm_workload import bench_shm
from wake_latency import bench_wake

WORKLOADS = {
    "get_meta_state": bench_get_meta_state,
    "get_meta": bench_get_meta,
    "concurrent": bench_concurrent,
    "small": bench_small,
    "grpo": bench_grpo,
    "large": bench_large,
    "wake": bench_wake,
    "auth": bench_auth,
    "journal": bench_journal,
    "shm": bench_shm,
    "gpu": bench_gpu,
}
