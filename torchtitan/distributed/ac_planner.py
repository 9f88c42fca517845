"""Mode "auto": choose, per block, how much to recompute so that a step fits a memory budget.

The choices (`BLOCK_CHOICES`) are three of the AC module's: "none", "op" (per-op SAC) and
"full". The planner needs, for each group of blocks one device holds (the whole model, or one pipeline
rank's stages), measurements of three uniform runs, one per choice (`RankCosts`):

- the step's peak with every block at that choice;
- per block, the bytes one forward holds for backward, and the FLOPs the step recomputes in it.

A choice saves, over the whole group, what the peaks say (no AC's peak less that choice's); it
is shared among the blocks in proportion to what each holds less under it than under no AC
(`RankCosts.saving`). So the peaks calibrate the per-block bytes: a pipeline rank that holds
several microbatches at once saves that many times a block's bytes, and bytes a forward keeps
that the peak never sees do not count. A plan's peak is modelled as no AC's peak less its
blocks' savings, never below full AC's (`RankCosts.estimated_peak`); it is exact for the three
uniform plans. `solve` finds the plan with the least recompute FLOPs whose modelled peak fits
(a multiple-choice knapsack by dynamic programming over the bytes to save, in units of
1/`RESOLUTION` of them; see `solve` for how rounding is kept from costing a plan). The memory estimator
(`scripts/estimate_memory.py --plan`) measures the chosen plan's peak on fake tensors and
re-solves with a tighter target where the model was short; the trainer runs it at startup
(`ac_auto.py`).

Recompute FLOPs become time at one throughput (`auto_tflops`), so the FLOPs alone decide; the
host cost of op-SAC's per-op dispatch is not modelled (see docs/ac_auto.md).
"""

import json
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from torchtitan.distributed.activation_checkpoint import format_block_plan, nothing_fits

GiB = 2**30
# What the planner chooses among, from the least recompute to the most. Not "regions"
# (`CheapRegionsAC`): its recompute is element-wise work, which FLOP counts do not see, so the
# FLOP cost model would take it for free.
BLOCK_CHOICES = ("none", "op", "full")
# The solver counts the bytes a plan must save in at most this many units: each block's saving,
# rounded down to a unit, is then short by less than 1/RESOLUTION of what must be saved.
RESOLUTION = 2**14


@dataclass(frozen=True)
class BlockCost:
    """One block's measurements, per choice.

    Attributes:
        index: the block's index in the whole model.
        held: bytes one forward of the block holds for backward.
        recompute: FLOPs the step recomputes in the block, all micro-batches included.
    """

    index: int
    held: dict[str, int]
    recompute: dict[str, int]

    def held_less(self, choice: str) -> int:
        """Bytes one forward holds less under `choice` than under no AC (never negative)."""
        return max(0, self.held["none"] - self.held[choice])

    def recompute_flops(self, choice: str) -> int:
        """FLOPs a step spends recomputing this block under `choice`."""
        return self.recompute[choice]


@dataclass(frozen=True)
class RankCosts:
    """The measurements of one device's blocks: `peak[choice]` is the step's peak with every
    block at `choice`; `label` names the device ("" for the whole model, "pp 1", ...)."""

    label: str
    peak: dict[str, int]
    blocks: tuple[BlockCost, ...]

    @cached_property
    def _held_less(self) -> dict[str, int]:
        return {choice: sum(b.held_less(choice) for b in self.blocks) for choice in self.peak}

    def saving(self, block: BlockCost, choice: str) -> float:
        """The bytes `choice` on `block` takes off the step's peak: the group's saving under
        `choice` (no AC's peak less that choice's), shared by the blocks' `held_less`."""
        held_less = self._held_less[choice]
        if held_less <= 0:
            return 0.0
        return max(0, self.peak["none"] - self.peak[choice]) * block.held_less(choice) / held_less

    def estimated_peak(self, choices: dict[int, str]) -> int:
        """The modelled step peak of `choices` (block index -> choice)."""
        saved = sum(self.saving(block, choices[block.index]) for block in self.blocks)
        return max(self.peak["full"], round(self.peak["none"] - saved))

    def recompute_flops(self, choices: dict[int, str]) -> int:
        return sum(block.recompute_flops(choices[block.index]) for block in self.blocks)


def solve(costs: RankCosts, budget: int) -> dict[int, str]:
    """The choices for `costs.blocks` with the least recompute FLOPs whose modelled peak
    (`RankCosts.estimated_peak`) is at most `budget` bytes. Ties go to the choice listed first
    in `BLOCK_CHOICES` (the least recompute), block by block, so equal inputs give equal plans.

    Savings count in whole units of 1/`RESOLUTION` of the bytes to save, each block's rounded
    down. A first pass asks for as many units as any fitting plan has (the bytes to save less
    one unit per block), so no fitting plan is missed and the answer costs at most the exact
    optimum; if its answer does not fit (rounding let it through, short by less than a unit a
    block), a second pass asks for the units rounding down guarantees to fit.

    Raises:
        NothingFits: when even full AC on every block is modelled above `budget`.
    """
    if costs.peak["full"] > budget:
        raise nothing_fits(budget, costs.peak["full"], costs.label)
    need = max(0, costs.peak["none"] - budget)
    granule = max(1, -(-need // RESOLUTION))
    units = [[int(costs.saving(block, c)) // granule for c in BLOCK_CHOICES] for block in costs.blocks]
    cost = [[block.recompute_flops(c) for c in BLOCK_CHOICES] for block in costs.blocks]
    enough = -(-need // granule)
    choices = _least_cost(costs.blocks, units, cost, max(0, enough - len(costs.blocks)))
    if costs.estimated_peak(choices) <= budget:
        return choices
    if sum(max(u) for u in units) < enough:
        # Rounding down lost the last units: every block at its largest saving, which the
        # full-AC check above proved fits.
        return {block.index: "full" for block in costs.blocks}
    return _least_cost(costs.blocks, units, cost, enough)


def _least_cost(blocks, units: list[list[int]], cost: list[list[int]], target: int) -> dict[int, str]:
    """The multiple-choice knapsack: per block the choice (an index into `BLOCK_CHOICES`) with
    the least total cost whose units add up to at least `target`, by dynamic programming."""
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
    for block, block_units, pick in zip(reversed(blocks), reversed(units), reversed(picks)):
        c = int(pick[t])
        choices[block.index] = BLOCK_CHOICES[c]
        t = max(0, t - block_units[c])
    return choices


@dataclass
class BlockPlan:
    """A solved plan: the choice per block, and per device group its modelled and measured
    peaks and recompute FLOPs per step.

    Attributes:
        choices: block index -> choice.
        budget: the bytes it was planned for.
        ranks: per device label, {"estimated", "measured", "recompute_flops", "full_flops_recompute"}.
        saving: block index -> choice -> bytes it takes off the peak (`RankCosts.saving`).
        recompute: block index -> choice -> recompute FLOPs per step (for the table).
        fingerprint: what the plan was made for (`ac_auto.layout_fingerprint`).
    """

    choices: dict[int, str]
    budget: int
    ranks: dict[str, dict[str, int]]
    saving: dict[int, dict[str, int]]
    recompute: dict[int, dict[str, int]]
    fingerprint: str = ""

    @property
    def spec(self) -> str:
        """The `auto_plan` string."""
        return format_block_plan(self.choices)

    def table(self, tflops: float) -> str:
        """A Markdown table: per block its choice, the bytes that takes off the peak, and its
        recompute per step in GFLOP and in ms at `tflops` TFLOP/s; then one line per device."""
        lines = [
            "| block | choice | off the peak, MiB | recompute per step, GFLOP | recompute per step, ms |",
            "|---|---|---|---|---|",
        ]
        for index in sorted(self.choices):
            choice = self.choices[index]
            flops = self.recompute[index][choice]
            lines.append(
                f"| {index} | {choice} | {self.saving[index][choice] / 2**20:.1f} | {flops / 1e9:.2f} | "
                f"{1e3 * flops / (tflops * 1e12):.3f} |"
            )
        counts = [f"{c} on {list(self.choices.values()).count(c)}" for c in BLOCK_CHOICES]
        lines.append(f"\nBlocks: {', '.join(counts)} of {len(self.choices)}.")
        for label, r in self.ranks.items():
            where = f" on {label}" if label else ""
            ms = 1e3 * r["recompute_flops"] / (tflops * 1e12)
            full_ms = 1e3 * r["full_flops_recompute"] / (tflops * 1e12)
            lines.append(
                f"Peak{where}: {r['measured'] / GiB:.3f} GiB measured on fake tensors, "
                f"{r['estimated'] / GiB:.3f} GiB modelled, budget {self.budget / GiB:.3f} GiB; "
                f"recompute {ms:.1f} ms per step (full AC: {full_ms:.1f} ms) at {tflops:g} TFLOP/s."
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BlockPlan":
        raw = json.loads(text)
        ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731  (JSON keys are strings)
        return cls(
            choices=ints(raw["choices"]), budget=raw["budget"], ranks=raw["ranks"],
            saving=ints(raw["saving"]), recompute=ints(raw["recompute"]),
            fingerprint=raw.get("fingerprint", ""),
        )  # fmt: skip
