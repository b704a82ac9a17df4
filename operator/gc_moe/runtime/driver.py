"""The CUDA driver API through cuda-bindings, imported on first use, and one error check for every call."""

from __future__ import annotations

import importlib
from typing import Any


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error; the message names the call and the driver's error name."""

    def __init__(self, what: str, code: Any):
        self.code = code
        name = getattr(code, "name", str(code))
        super().__init__(f"{what} failed: {name}")


class _LazyDriver:
    """`cu.cuInit(...)` imports cuda.bindings.driver on first attribute access (the package is optional)."""

    _mod = None

    def __getattr__(self, name: str):
        if _LazyDriver._mod is None:
            try:
                _LazyDriver._mod = importlib.import_module("cuda.bindings.driver")
            except ImportError as exc:  # the runtime path needs only cuda-bindings, but it needs it
                raise ImportError("the GPU runtime needs cuda-bindings (pip install 'cuda-python>=12.8')") from exc
        return getattr(_LazyDriver._mod, name)


cu = _LazyDriver()


def check(result, what: str):
    """Unpack a cuda-bindings result tuple: raise on error, return the value (or tuple of values, or None)."""
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if int(err) != 0:
        raise CudaDriverError(what, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def driver_version() -> int:
    """cuDriverGetVersion, e.g. 13000 for a CUDA 13.0 driver."""
    check(cu.cuInit(0), "cuInit")
    return int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
