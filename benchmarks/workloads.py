"""The workloads by name (see metadata_workloads.py and payload_workloads.py)."""

from metadata_workloads import bench_concurrent, bench_get_meta, bench_get_meta_state
from payload_workloads import bench_grpo, bench_large, bench_small

WORKLOADS = {
    "get_meta_state": bench_get_meta_state,
    "get_meta": bench_get_meta,
    "concurrent": bench_concurrent,
    "small": bench_small,
    "grpo": bench_grpo,
    "large": bench_large,
}
