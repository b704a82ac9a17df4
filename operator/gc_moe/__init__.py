"""GC-MoE: FP8xFP4 expert-parallel MoE decode on CUDA Green Contexts (public API: Listing 1 of the paper)."""

__version__ = "0.1.0"
