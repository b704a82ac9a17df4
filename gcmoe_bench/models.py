"""Model shapes of the paper's Table 4, read from the packaged ``data/models.csv``."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer's shape as the sweep runs it (global expert count; experts split evenly over ranks)."""

    name: str  # what results call it: the Table 4 model it stands for, or a shrunken variant's own name
    base: str  # the Table 4 model it derives from
    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    num_shared_experts: int
    shared_k_group: int
    capacity: int  # per-rank token capacity
    activation_alpha: float = 1.0
    activation_clamp: float = 10.0

    def experts_per_rank(self, num_ranks: int) -> int:
        if self.num_experts % num_ranks:
            raise ValueError(
                f"model {self.name!r}: {self.num_experts} experts do not split evenly over {num_ranks} ranks; "
                f"use a rank count that divides {self.num_experts}"
            )
        return self.num_experts // num_ranks


@cache
def table4_models() -> dict[str, ModelShape]:
    """The paper's production models (Table 4), keyed by name."""
    text = resources.files("gcmoe_bench").joinpath("data/models.csv").read_text()
    models = {}
    for row in csv.DictReader(text.splitlines()):
        models[row["model"]] = ModelShape(
            name=row["model"],
            base=row["model"],
            hidden=int(row["hidden"]),
            intermediate=int(row["intermediate"]),
            num_experts=int(row["experts"]),
            topk=int(row["topk"]),
            num_shared_experts=int(row["shared_experts"]),
            shared_k_group=int(row["shared_k_group"]),
            capacity=int(row["capacity"]),
            activation_alpha=float(row["alpha"]),
            activation_clamp=float(row["clamp"]),
        )
    return models
