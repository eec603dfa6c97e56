"""The fused kernels: one dispatcher (``dispatch.py``) between the reference math
(``reference.py``, the spec) and the compiled extension (``build.py``: just in time, or prebuilt);
norm partials of shards (``partials.py``).

``shardamp.optim.kernels.backend(device)`` says which one runs for a device type.
"""
from .dispatch import (CUDA_STEP_SHAPES, AdamLaunch, launch_adam, LIGHT_STATE_CUDA_CHUNK, REMAINDERS_CUDA_CHUNK, StepRecords, adam_step,
                       backend, chunk_table, cuda_chunk, cuda_step_shape, grad_stats, grad_stats_after, land_grads,
                       light_state, native_module, prepare, refresh_knobs, requested_backend, stats_finish,
                       step_scalars, view_check)

__all__ = [
    "AdamLaunch", "launch_adam", "CUDA_STEP_SHAPES", "LIGHT_STATE_CUDA_CHUNK", "REMAINDERS_CUDA_CHUNK", "StepRecords", "adam_step", "backend",
    "chunk_table", "cuda_chunk", "cuda_step_shape", "grad_stats", "grad_stats_after", "land_grads", "light_state",
    "native_module", "prepare", "refresh_knobs", "requested_backend", "stats_finish", "step_scalars", "view_check",
]
