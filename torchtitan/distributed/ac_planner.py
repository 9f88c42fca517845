"""Mode "auto": choose, per block, how much to recompute so that a step fits a memory budget.

The choices (`BLOCK_CHOICES`) are the AC module's: "none", "regions" (the block's cheap regions,
each a plain checkpoint), "op" (per-op SAC, every second matmul recomputed), "op_all_mm" (per-op
SAC, every matmul recomputed), "full", and "op_offload" and "full_offload" (op-SAC or full AC
with what the block keeps offloaded to host memory). A layout may plan with fewer (no offload on
the CPU or with compiled blocks). The planner needs, for each group of blocks one device holds
(the whole model, or one pipeline rank's stages), measurements of one uniform run per choice
(`RankCosts`):

- the step's peak with every block at that choice;
- per block, the bytes one forward holds for backward, and what the step runs in it
  (`BlockWork`: FLOPs, bytes of element-wise work, ops dispatched, regions rerun, bytes
  offloaded).

A choice saves, over the whole group, what the peaks say (no AC's peak less that choice's); it
is shared among the blocks in proportion to what each holds less under it than under no AC
(`RankCosts.saving`). So the peaks calibrate the per-block bytes: a pipeline rank that holds
several microbatches at once saves that many times a block's bytes, and bytes a forward keeps
that the peak never sees do not count. A choice whose uniform peak is set outside the
activations (by the optimizer step, say) takes the rate of a choice whose peak is higher. A plan's peak
is modelled as no AC's peak less its blocks' savings, never below the least uniform peak
(`RankCosts.estimated_peak`); it is exact for the uniform plans.

A choice costs the time it adds to the block's step (`RankCosts.seconds`). A block's time is
its device's or its host's, whichever is longer (`RecomputeRates.seconds`): the device's from
its FLOPs at the math throughput and its element-wise bytes at the memory's, the host's per op
dispatched and per region rerun. The host term is what makes op-SAC dear where kernels are
short: its Python dispatch mode sees every op of the block twice. An offloading choice adds the
copy time that compute does not hide (`RecomputeRates.exposed_copy_seconds`). `solve` finds the
plan with the least added time whose modelled peak fits (a multiple-choice knapsack by dynamic
programming over the bytes to save, in units of 1/`RESOLUTION` of them; see `solve` for how
rounding is kept from costing a plan).
The memory estimator (`scripts/estimate_memory.py --plan`) measures the chosen plan's peak on
fake tensors and re-solves with a tighter target where the model was short; the trainer runs it
at startup (`ac_auto.py`).
"""

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np

from torchtitan.distributed.activation_checkpoint import (
    AUTO_PLAN_CHOICES,
    OFFLOAD_CHOICES,
    format_block_plan,
    nothing_fits,
)

GiB = 2**30
# What the planner chooses among: every choice of the AC module's mode "auto", from the least
# memory saved to the most.
BLOCK_CHOICES = AUTO_PLAN_CHOICES
# The solver counts the bytes a plan must save in at most this many units: each block's saving,
# rounded down to a unit, is then short by less than 1/RESOLUTION of what must be saved.
RESOLUTION = 2**14


@dataclass(frozen=True)
class BlockWork:
    """What one step runs in one block under one choice: its forward, its backward and its
    recompute, all micro-batches (`op_counter.RecomputeCost`).

    Attributes:
        flops: FLOPs of the ops that have a FLOP formula (matmuls, attention).
        memory_bytes: bytes written by the other ops (element-wise work, copies).
        host_ops: ops the host dispatches: each op once, and under SAC each op of the forward
            and of its recompute once more (SAC's Python dispatch mode).
        reruns: checkpointed regions rerun.
        recompute_flops: of `flops`, those of the recompute.
        offloaded_bytes: bytes copied to host memory in forward (and back in backward).
    """

    flops: int = 0
    memory_bytes: int = 0
    host_ops: int = 0
    reruns: int = 0
    recompute_flops: int = 0
    offloaded_bytes: int = 0


@dataclass(frozen=True)
class RecomputeRates:
    """What turns a `BlockWork` into seconds (`seconds`).

    Attributes:
        tflops: the math throughput, TFLOP/s.
        memory_gbps: the memory throughput of element-wise work, GB/s; each byte written is
            taken to be read once too.
        host_us_per_op: host time per op dispatched, µs.
        host_us_per_rerun: host time per region rerun (the checkpoint's own work), µs.
        offload_gbps: the host-device bandwidth per direction of offload copies, GB/s; 0
            (the default) where the plan does not offload.
    """

    tflops: float
    memory_gbps: float
    host_us_per_op: float
    host_us_per_rerun: float
    offload_gbps: float = 0.0

    def device_seconds(self, work: BlockWork) -> float:
        return work.flops / (self.tflops * 1e12) + 2 * work.memory_bytes / (self.memory_gbps * 1e9)

    def host_seconds(self, work: BlockWork) -> float:
        return (work.host_ops * self.host_us_per_op + work.reruns * self.host_us_per_rerun) * 1e-6

    def seconds(self, work: BlockWork) -> float:
        """The block's time in the step: the device's or the host's, whichever is longer. The
        host queues kernels ahead of the device, so its time costs only where it is the longer
        (short kernels: small blocks, short sequences, op-SAC's many ops)."""
        return max(self.device_seconds(work), self.host_seconds(work))

    def exposed_copy_seconds(self, work: BlockWork, compute_seconds: float) -> float:
        """The time a block's offload copies (`work.offloaded_bytes`, out and back) add to the
        step beside `compute_seconds` of compute per block (forward and backward).

        The copies run on side streams: a block's copy out overlaps the next block's forward,
        taken as a third of `compute_seconds`, and its copy back the backward of the block after
        it, the other two thirds (a backward costs about twice its forward). What a copy takes
        beyond its window is exposed."""
        if not work.offloaded_bytes:
            return 0.0
        copy = work.offloaded_bytes / (self.offload_gbps * 1e9)
        forward = compute_seconds / 3
        return max(0.0, copy - forward) + max(0.0, copy - 2 * forward)

    def describe(self) -> str:
        copies = f", copies at {self.offload_gbps:g} GB/s" if self.offload_gbps else ""
        return (
            f"{self.tflops:g} TFLOP/s, {self.memory_gbps:g} GB/s, host {self.host_us_per_op:g} µs per op "
            f"and {self.host_us_per_rerun:g} µs per region rerun{copies}"
        )


@dataclass(frozen=True)
class BlockCost:
    """One block's measurements, per choice.

    Attributes:
        index: the block's index in the whole model.
        held: bytes one forward of the block makes and holds for backward on the device (its
            input, made by the block before, is not counted).
        work: what the step runs in the block, all micro-batches included.
        offloaded: bytes one forward offloads (under the offloading choices).
    """

    index: int
    held: dict[str, int]
    work: dict[str, BlockWork]
    offloaded: dict[str, int] = field(default_factory=dict)

    def held_less(self, choice: str) -> int:
        """Bytes one forward holds less on the device under `choice` than under no AC (never
        negative).

        An offloading choice keeps on the device what the choice it offloads from
        (`OFFLOAD_CHOICES`) keeps, less all it offloads, the block's input included (which
        `held` does not count)."""
        if choice in OFFLOAD_CHOICES:
            kept = OFFLOAD_CHOICES[choice]
            return max(0, self.held["none"] - self.held[kept] + self.offloaded.get(choice, 0))
        return max(0, self.held["none"] - self.held[choice])

    def recompute_flops(self, choice: str) -> int:
        """FLOPs a step spends recomputing this block under `choice`."""
        return self.work[choice].recompute_flops


def floor_of(peak: dict[str, int]) -> str:
    """Of full AC and full AC with offload, those `peak` (choice -> uniform peak) holds, the one
    of the lower peak; full AC on a tie."""
    return min((c for c in ("full", "full_offload") if c in peak), key=peak.__getitem__)


@dataclass(frozen=True)
class RankCosts:
    """The measurements of one device's blocks: `peak[choice]` is the step's peak with every
    block at `choice`; `label` names the device ("" for the whole model, "pp 1", ...); `rates`
    prices their recompute."""

    label: str
    peak: dict[str, int]
    blocks: tuple[BlockCost, ...]
    rates: RecomputeRates

    @property
    def choices(self) -> tuple[str, ...]:
        """The choices measured, in `BLOCK_CHOICES`' order (least saving first)."""
        return tuple(c for c in BLOCK_CHOICES if c in self.peak)

    @property
    def floor(self) -> str:
        """The choice of the least uniform peak a plan can reach (`floor_of`). No plan is
        modelled below it."""
        return floor_of(self.peak)

    @cached_property
    def _held_less(self) -> dict[str, int]:
        return {choice: sum(b.held_less(choice) for b in self.blocks) for choice in self.peak}

    @cached_property
    def _peak_per_byte(self) -> dict[str, float]:
        """Per choice, the bytes of peak that one byte held less takes off: no AC's peak less
        the choice's, over what its blocks hold less; or, where larger, the rate of a choice whose
        uniform peak is higher.

        Why: a uniform run's peak can be set outside the activations, by the optimizer step or
        the loss head, and then shows less than the choice saves. The higher a choice's peak,
        the more surely its activations set it; a choice that saves more is only clipped more."""
        own = {
            c: max(0, self.peak["none"] - self.peak[c]) / self._held_less[c]
            for c in self.choices
            if c != "none" and self._held_less[c] > 0
        }
        return {
            c: max((rate for other, rate in own.items() if self.peak[other] >= self.peak[c]), default=0.0)
            for c in self.choices
        }

    def saving(self, block: BlockCost, choice: str) -> float:
        """The bytes `choice` on `block` takes off the step's peak: what it holds less than
        under no AC, at `_peak_per_byte`'s rate for `choice`."""
        return self._peak_per_byte[choice] * block.held_less(choice)

    def estimated_peak(self, choices: dict[int, str]) -> int:
        """The modelled step peak of `choices` (block index -> choice)."""
        saved = sum(self.saving(block, choices[block.index]) for block in self.blocks)
        return max(self.peak[self.floor], round(self.peak["none"] - saved))

    def recompute_flops(self, choices: dict[int, str]) -> int:
        return sum(block.recompute_flops(choices[block.index]) for block in self.blocks)

    def seconds(self, block: BlockCost, choice: str) -> float:
        """The modelled time `choice` adds to the step in `block`: `RecomputeRates.seconds`
        under it less under no AC, and the copy time that no AC's compute does not hide
        (`RecomputeRates.exposed_copy_seconds`)."""
        work, none = block.work[choice], block.work["none"]
        added = max(0.0, self.rates.seconds(work) - self.rates.seconds(none))
        return added + self.rates.exposed_copy_seconds(work, self.rates.device_seconds(none))

    def added_seconds(self, choices: dict[int, str]) -> float:
        return sum(self.seconds(block, choices[block.index]) for block in self.blocks)


def solve(costs: RankCosts, budget: int) -> dict[int, str]:
    """The choices for `costs.blocks` with the least modelled added time
    (`RankCosts.seconds`) whose modelled peak (`RankCosts.estimated_peak`) is at most `budget`
    bytes. Ties go to the choice listed first in `BLOCK_CHOICES` (the least saving), block by
    block, so equal inputs give equal plans.

    Savings count in whole units of 1/`RESOLUTION` of the bytes to save, each block's rounded
    down. A first pass asks for as many units as any fitting plan has (the bytes to save less
    one unit per block), so no fitting plan is missed and the answer costs at most the exact
    optimum; if its answer does not fit (rounding let it through, short by less than a unit a
    block), a second pass asks for the units rounding down guarantees to fit.

    Raises:
        NothingFits: when even the least uniform peak (`RankCosts.floor`) is above `budget`.
    """
    floor = costs.floor
    if costs.peak[floor] > budget:
        raise nothing_fits(budget, costs.peak[floor], costs.label, offload=floor in OFFLOAD_CHOICES)
    need = max(0, costs.peak["none"] - budget)
    granule = max(1, -(-need // RESOLUTION))
    units = [[int(costs.saving(block, c)) // granule for c in costs.choices] for block in costs.blocks]
    cost = [[costs.seconds(block, c) for c in costs.choices] for block in costs.blocks]
    enough = -(-need // granule)
    choices = _least_cost(costs, units, cost, max(0, enough - len(costs.blocks)))
    if costs.estimated_peak(choices) <= budget:
        return choices
    if sum(max(u) for u in units) < enough:
        # Rounding down lost the last units: every block at the floor, which the check above
        # proved fits.
        return {block.index: floor for block in costs.blocks}
    return _least_cost(costs, units, cost, enough)


def _least_cost(
    costs: RankCosts, units: list[list[int]], cost: list[list[float]], target: int
) -> dict[int, str]:
    """The multiple-choice knapsack: per block of `costs` the choice (an index into
    `costs.choices`) with the least total cost whose units add up to at least `target`, by
    dynamic programming."""
    # best[t]: the least cost to save at least t units with the blocks seen so far.
    best = np.full(target + 1, np.inf)
    best[0] = 0.0
    reach = np.arange(target + 1)
    picks = []
    for block_units, block_cost in zip(units, cost):
        options = np.stack([best[np.maximum(0, reach - u)] + c for u, c in zip(block_units, block_cost)])
        picks.append(np.argmin(options, axis=0))  # the first of equal options
        best = options.min(axis=0)
    choices, t = {}, target
    for block, block_units, pick in zip(reversed(costs.blocks), reversed(units), reversed(picks)):
        c = int(pick[t])
        choices[block.index] = costs.choices[c]
        t = max(0, t - block_units[c])
    return choices


@dataclass
class BlockPlan:
    """A solved plan: the choice per block, and per device group its modelled and measured
    peaks and its recompute per step.

    Attributes:
        choices: block index -> choice.
        budget: the bytes it was planned for.
        ranks: per device label, {"estimated", "measured" (peak bytes), "recompute_flops",
            "added_ms", "full_ac_added_ms" (full AC on every block, for comparison)}.
        saving: block index -> choice -> bytes it takes off the peak (`RankCosts.saving`).
        recompute: block index -> choice -> recompute FLOPs per step.
        added_ms: block index -> choice -> the time it adds to the step, modelled, ms
            (`RankCosts.seconds`).
        rates: what priced the recompute (`RecomputeRates.describe`).
        fingerprint: what the plan was made for (`ac_auto.layout_fingerprint`).
    """

    choices: dict[int, str]
    budget: int
    ranks: dict[str, dict[str, float]]
    saving: dict[int, dict[str, int]]
    recompute: dict[int, dict[str, int]]
    added_ms: dict[int, dict[str, float]]
    rates: str
    fingerprint: str = ""

    @property
    def spec(self) -> str:
        """The `auto_plan` string."""
        return format_block_plan(self.choices)

    def table(self) -> str:
        """A Markdown table: per block its choice, the bytes that takes off the peak, its
        recompute FLOPs per step, and the time it adds to the step (modelled); then one line
        per device."""
        lines = [
            "| block | choice | off the peak, MiB | recompute per step, GFLOP | added per step, ms |",
            "|---|---|---|---|---|",
        ]
        for index in sorted(self.choices):
            choice = self.choices[index]
            lines.append(
                f"| {index} | {choice} | {self.saving[index][choice] / 2**20:.1f} | "
                f"{self.recompute[index][choice] / 1e9:.2f} | {self.added_ms[index][choice]:.3f} |"
            )
        planned = [c for c in BLOCK_CHOICES if any(c in by_choice for by_choice in self.saving.values())]
        counts = [f"{c} on {list(self.choices.values()).count(c)}" for c in planned]
        lines.append(f"\nBlocks: {', '.join(counts)} of {len(self.choices)}.")
        for label, r in self.ranks.items():
            where = f" on {label}" if label else ""
            lines.append(
                f"Peak{where}: {r['measured'] / GiB:.3f} GiB measured on fake tensors, "
                f"{r['estimated'] / GiB:.3f} GiB modelled, budget {self.budget / GiB:.3f} GiB; "
                f"adds {r['added_ms']:.1f} ms per step (full AC: {r['full_ac_added_ms']:.1f} ms)."
            )
        lines.append(f"Recompute priced at {self.rates}.")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BlockPlan":
        """Raises ValueError or KeyError for text that is not a plan (or one of an older
        release's format)."""
        raw = json.loads(text)
        ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731  (JSON keys are strings)
        return cls(
            choices=ints(raw["choices"]), budget=raw["budget"], ranks=raw["ranks"],
            saving=ints(raw["saving"]), recompute=ints(raw["recompute"]),
            added_ms=ints(raw["added_ms"]), rates=raw["rates"],
            fingerprint=raw.get("fingerprint", ""),
        )  # fmt: skip


def plan_of(
    costs: list[RankCosts], choices: dict[int, str], budget: int, measured: dict[str, int]
) -> BlockPlan:
    """The `BlockPlan` of `choices` (block index -> choice) for the devices `costs` describe,
    with each device's `measured` peak."""
    ranks = {
        c.label: {
            "estimated": c.estimated_peak(choices), "measured": measured[c.label],
            "recompute_flops": c.recompute_flops(choices),
            "added_ms": 1e3 * c.added_seconds(choices),
            "full_ac_added_ms": 1e3 * c.added_seconds({b.index: "full" for b in c.blocks}),
        }
        for c in costs
    }  # fmt: skip

    def per_block(value) -> dict[int, dict[str, float]]:
        return {b.index: {ch: value(c, b, ch) for ch in c.choices} for c in costs for b in c.blocks}

    return BlockPlan(
        choices=dict(sorted(choices.items())), budget=budget, ranks=ranks,
        saving=per_block(lambda c, b, ch: round(c.saving(b, ch))),
        recompute=per_block(lambda c, b, ch: b.recompute_flops(ch)),
        added_ms=per_block(lambda c, b, ch: 1e3 * c.seconds(b, ch)),
        rates=costs[0].rates.describe(),
    )  # fmt: skip
