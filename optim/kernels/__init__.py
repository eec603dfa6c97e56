"""The fused kernels: one dispatcher (``dispatch.py``) between the reference math
(``reference.py``, the spec) and the compiled extension (``build.py``: just in time, or prebuilt);
the Adam step's launches (``adam_launch.py``: each bucket's launch, all of a step's in one call);
the CUDA step's launch configuration (``launch_config.py``: chunk sizes, tuning knobs, chunk
tables); norm partials of shards (``partials.py``).

``shardamp.optim.kernels.backend(device)`` says which one runs for a device type.
"""
from .dispatch import (backend, bucket_stats, grad_stats, group_partials, group_partials_all, group_partials_held,
                       held_bucket_params, holds_grads, land_grads, native_module, nonfinite_flags, requested_backend,
                       stats_finish, step_scalars, view_check)
from .adam_launch import AdamLaunch, StepRecords, adam_step, launch_adam, launch_adam_all, prepare
from .blockwise import check_formats
from .launch_config import (CUDA_STEP_SHAPES, LIGHT_STATE_CUDA_CHUNK, REMAINDERS_CUDA_CHUNK, chunk_table, cuda_chunk,
                            cuda_step_shape, light_state, refresh_knobs)

__all__ = [
    "AdamLaunch", "check_formats", "launch_adam", "launch_adam_all", "CUDA_STEP_SHAPES", "LIGHT_STATE_CUDA_CHUNK",
    "REMAINDERS_CUDA_CHUNK", "StepRecords", "adam_step", "backend", "bucket_stats", "chunk_table", "cuda_chunk",
    "cuda_step_shape", "grad_stats", "group_partials", "group_partials_all", "group_partials_held", "held_bucket_params",
    "holds_grads", "land_grads", "light_state", "native_module", "nonfinite_flags", "prepare", "refresh_knobs",
    "requested_backend", "stats_finish", "step_scalars", "view_check",
]
