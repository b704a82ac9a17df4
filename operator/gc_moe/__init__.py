"""GC-MoE: FP8xFP4 expert-parallel MoE decode on CUDA Green Contexts (public API: Listing 1 of the paper)."""

from .api import (
    Backend,
    GcMoeBuffer,
    fp8_fp4_gc_moe,
    get_symm_buffer_for_gc_moe,
    register_backend,
    transform_weights_for_gc_moe,
)
from .planning import GcMoeConstraintError

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "GcMoeBuffer",
    "GcMoeConstraintError",
    "fp8_fp4_gc_moe",
    "get_symm_buffer_for_gc_moe",
    "register_backend",
    "transform_weights_for_gc_moe",
]
