"""Per-architecture weight layouts behind one dispatcher.

Layouts:
- "canonical": DeepGEMM's input layout as `formats.quantize_moe_weights` produces it
  (L1 int8 [E, 2I, H/2] + int32 [E, 2I, H/128] with rows [gate; up]; L2 int8 [E, H, I/2] + int32 [E, H, I/128]).
  The reference backend consumes this layout.
- "sm103": the K128 tile-contiguous prepack (`weights/sm103.py`).
- "sm90": the MXFP4 window repack (`weights/sm90.py`).

Every arch module provides `transform(l1, l2)` and `inverse(...)`. `transform` returns either a pair (w1, w2)
of tuples, inverted by `inverse(w1, w2) -> (l1, l2)` (sm103), or one object with `.l1` and `.l2`, inverted by
`inverse(obj) -> (l1, l2)` (sm90). The dispatcher hands out (w1, w2) either way, each tagged with its layout
(`LayoutTaggedWeights`), so an operator call can check that the weights it is handed are in the layout its
backend reads, and convert them back to canonical when it is not.
"""

from __future__ import annotations

import importlib

CANONICAL = "canonical"
ARCH_LAYOUTS = ("sm90", "sm103")
LAYOUTS = (CANONICAL, *ARCH_LAYOUTS)
_MODULE_OWNING = {
    "sm90": "the SM90 MXFP4 window repack (gc_moe.weights.sm90)",
    "sm103": "the SM103 K128 prepack (gc_moe.weights.sm103)",
}


class LayoutTaggedWeights(tuple):
    """A weight tuple (data, scales[, ...]) that remembers its layout ('canonical', 'sm90', 'sm103') and which
    GEMM it feeds ('l1' or 'l2'). It unpacks like the plain tuple it wraps."""

    layout: str
    stage: str
    bundle: object

    def __new__(cls, parts, layout: str, stage: str):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown weight layout {layout!r}; allowed: {LAYOUTS}")
        if stage not in ("l1", "l2"):
            raise ValueError(f"unknown weight stage {stage!r}; allowed: 'l1' or 'l2'")
        obj = super().__new__(cls, parts)
        obj.layout = layout
        obj.stage = stage
        return obj

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(getattr(p, "shape", ()))) for p in self)
        return f"LayoutTaggedWeights(layout={self.layout!r}, stage={self.stage!r}, shapes=[{shapes}])"


def layout_of(weights) -> str:
    """The layout tag of a weight tuple; an untagged tuple is taken to be canonical. Only a
    LayoutTaggedWeights carries a tag (a torch.Tensor has a `.layout` too: torch.strided, not ours)."""
    return weights.layout if isinstance(weights, LayoutTaggedWeights) else CANONICAL


def arch_module(arch: str):
    """The transform module of `arch`, or a clear NotImplementedError naming the piece that is missing."""
    if arch not in ARCH_LAYOUTS:
        raise ValueError(f"no weight transform for arch {arch!r}; allowed: {ARCH_LAYOUTS}")
    name = f"{__name__}.{arch}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        raise NotImplementedError(
            f"weights for {arch} need {_MODULE_OWNING[arch]}, which is not part of this build yet"
        ) from None
    for fn in ("transform", "inverse"):
        if not callable(getattr(module, fn, None)):
            raise NotImplementedError(
                f"weights for {arch} need {name}.{fn}(), which {_MODULE_OWNING[arch]} does not provide yet"
            )
    return module


def _tag(w1, w2, layout: str, bundle=None):
    w1, w2 = LayoutTaggedWeights(w1, layout, "l1"), LayoutTaggedWeights(w2, layout, "l2")
    w1.bundle = w2.bundle = bundle  # the arch module's own object, when its inverse wants it back whole
    return w1, w2


def transform(l1_weights, l2_weights, arch: str | None):
    """Canonical (l1, l2) -> (w1, w2) tagged with `arch`'s layout; arch None keeps the canonical layout."""
    if layout_of(l1_weights) != CANONICAL or layout_of(l2_weights) != CANONICAL:
        raise ValueError(
            f"weights are already transformed (layouts {layout_of(l1_weights)!r}, {layout_of(l2_weights)!r}); "
            f"transform_weights_for_gc_moe takes the canonical (DeepGEMM input) layout"
        )
    if arch is None:
        return _tag(tuple(l1_weights), tuple(l2_weights), CANONICAL)
    raw = arch_module(arch).transform(tuple(l1_weights), tuple(l2_weights))
    if hasattr(raw, "l1") and hasattr(raw, "l2"):
        return _tag((raw.l1,), (raw.l2,), arch, bundle=raw)
    if isinstance(raw, (tuple, list)) and len(raw) == 2:
        return _tag(raw[0], raw[1], arch)
    raise TypeError(
        f"gc_moe.weights.{arch}.transform returned {type(raw).__name__}; expected (w1, w2) or an "
        f"object with .l1 and .l2"
    )


def to_canonical(w1, w2):
    """(w1, w2) in any layout -> canonical (l1, l2), inverting the arch transform when there was one."""
    layout = layout_of(w1)
    if layout_of(w2) != layout:
        raise ValueError(f"w1 and w2 are in different layouts ({layout!r} and {layout_of(w2)!r})")
    if getattr(w1, "stage", "l1") != "l1" or getattr(w2, "stage", "l2") != "l2":
        raise ValueError(
            "w1 must be the L1 (gate/up) weights and w2 the L2 (down) weights; they look swapped"
        )
    if layout == CANONICAL:
        return tuple(w1), tuple(w2)
    module = arch_module(layout)
    bundle = getattr(w1, "bundle", None)
    if bundle is not None and bundle is getattr(w2, "bundle", None):
        l1, l2 = module.inverse(bundle)
    else:
        l1, l2 = module.inverse(tuple(w1), tuple(w2))
    return tuple(l1), tuple(l2)
