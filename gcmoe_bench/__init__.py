"""gcmoe-bench: the sweep driver, measurement protocol, results and report of the GC-MoE reproduction."""

__version__ = "0.1.0"
