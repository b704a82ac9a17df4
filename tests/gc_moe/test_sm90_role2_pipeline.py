"""The persistent role2 loop's handshakes, run on the CPU with the kernel's own arithmetic.

One CTA of the fused role2 kernel keeps one ring of stages across all its units (a unit's K128 steps are the
CTA's steps base .. base + k - 1) and hands units from the producer to the consumer warps through two slots.
Every wait of the device code is an mbarrier parity wait on a parity from `grouped_gemm.full_parity` /
`empty_parity` / `step_stage` and `role2.unit_slot` / `slot_full_parity` / `slot_empty_parity`; this test models
the barriers (try_wait.parity returns once the phase of that parity completed) and runs the producer and the
consumer warps in random interleavings: every consumer warp must see every unit, in order, each step's stage
holding that step's data, no stage refilled before every warp released it, and no interleaving may deadlock.
"""

import random

import pytest
from gc_moe.kernels.sm90 import grouped_gemm as gg
from gc_moe.kernels.sm90 import role2


class MBarrier:
    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        """PTX mbarrier.try_wait.parity: true once the phase of `parity` completed (the current one differs)."""
        return self.phase % 2 != parity


class Cta:
    def __init__(self, stages: int, consumer_warps: int, units: list[int]):
        self.stages, self.warps, self.units = stages, consumer_warps, units
        self.full = [MBarrier(1) for _ in range(stages)]  # the producer's arrivals stand in as one
        self.empty = [MBarrier(consumer_warps) for _ in range(stages)]
        self.slot_full = [MBarrier(1) for _ in range(gg.FUSED_UNIT_SLOTS)]
        self.slot_empty = [MBarrier(consumer_warps) for _ in range(gg.FUSED_UNIT_SLOTS)]
        self.slot = [None] * gg.FUSED_UNIT_SLOTS
        self.stage = [None] * stages  # (unit, step of the unit) the stage holds
        self.released = [consumer_warps] * stages  # warps that released the stage's content
        self.seen = {w: [] for w in range(consumer_warps)}
        # the first draw, before the loop (thread 0): slot 0 and its full barrier
        self.slot[0] = self.draw(0)
        self.slot_full[0].arrive()

    def draw(self, u):
        return self.units[u] if u < len(self.units) else None  # None: the final draw (expert -1)

    def producer(self):
        base, u = 0, 0
        while True:
            yield self.slot_full[role2.unit_slot(u)], role2.slot_full_parity(u)
            k = self.slot[role2.unit_slot(u)]
            if k is None:
                return
            for kb in range(k):
                step = base + kb
                st = gg.step_stage(step, self.stages)
                if step >= self.stages:
                    yield self.empty[st], gg.empty_parity(step, self.stages)
                assert self.released[st] == self.warps, "a stage refilled before every warp released it"
                self.stage[st], self.released[st] = (u, kb), 0
                self.full[st].arrive()
            base, u = base + k, u + 1
            if u >= gg.FUSED_UNIT_SLOTS:
                yield self.slot_empty[role2.unit_slot(u)], role2.slot_empty_parity(u)
            self.slot[role2.unit_slot(u)] = self.draw(u)
            self.slot_full[role2.unit_slot(u)].arrive()

    def consumer(self, warp: int):
        base, u = 0, 0
        while True:
            yield self.slot_full[role2.unit_slot(u)], role2.slot_full_parity(u)
            k = self.slot[role2.unit_slot(u)]
            if k is None:
                return
            self.seen[warp].append((u, k))
            self.slot_empty[role2.unit_slot(u)].arrive()
            prev = None
            for kb in range(k):
                step = base + kb
                st = gg.step_stage(step, self.stages)
                yield self.full[st], gg.full_parity(step, self.stages)
                assert self.stage[st] == (u, kb), f"warp {warp} read {self.stage[st]} for unit {u} step {kb}"
                if prev is not None:  # the previous step goes back once this one's first group is out
                    self.release(prev)
                prev = st
            self.release(prev)  # the unit's last stage too: the next unit's steps reuse it
            base, u = base + k, u + 1

    def release(self, st):
        self.released[st] += 1
        self.empty[st].arrive()


def run(stages: int, warps: int, units: list[int], rng: random.Random) -> Cta:
    cta = Cta(stages, warps, units)
    agents = {"p": cta.producer(), **{w: cta.consumer(w) for w in range(warps)}}
    waits = {name: next(gen) for name, gen in agents.items()}
    while waits:
        ready = [name for name, (bar, parity) in waits.items() if bar.passed(parity)]
        assert ready, f"deadlock: every agent waits ({sorted(map(str, waits))})"
        name = rng.choice(ready)
        try:
            waits[name] = next(agents[name])
        except StopIteration:
            del waits[name]
    return cta


@pytest.mark.parametrize("seed", range(60))
def test_units_reach_every_consumer_warp_in_order_through_one_ring_of_stages(seed):
    rng = random.Random(seed)
    stages = rng.choice([2, 3, 5, 11, 12])
    warps = rng.choice([1, 2, 4])
    # unit lengths around the ring's: shorter than it (the producer runs whole units ahead), equal, longer
    units = [rng.choice([1, 2, stages - 1 or 1, stages, stages + 1, 2 * stages + 3, 48]) for _ in range(rng.randint(1, 9))]
    cta = run(stages, warps, units, rng)
    for w in range(warps):
        assert cta.seen[w] == list(enumerate(units))


def test_no_unit_is_a_valid_launch():
    cta = run(4, 2, [], random.Random(0))
    assert cta.seen == {0: [], 1: []}


def test_the_model_catches_a_wrong_parity(monkeypatch):
    """The check can fail: with the empty barrier's parity of the current pass the producer refills stages
    the consumers still read."""
    monkeypatch.setattr(gg, "empty_parity", lambda step, stages: (step // stages) % 2)
    with pytest.raises(AssertionError):
        for seed in range(20):
            run(3, 2, [5, 7, 4], random.Random(seed))
