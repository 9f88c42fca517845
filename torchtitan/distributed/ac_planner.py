"""Mode "auto": choose, per block, how much to recompute so that a step fits a memory budget.

The choices are the AC module's (`BLOCK_CHOICES`): "none", "op" (per-op SAC) and "full". The
planner needs, for each group of blocks one device holds (the whole model, or one pipeline
rank's stages), measurements of three uniform runs, one per choice (`RankCosts`):

- the step's peak with every block at that choice;
- per block, the bytes one forward holds for backward, and the FLOPs the step runs in it.

From them, a plan's peak is modelled as the no-AC peak less what each block's choice saves,
times the number of forwards held at once (1 without pipelining; more on early pipeline
stages), and never below full AC's peak (`RankCosts.estimated_peak`). `solve` then finds the
plan with the least recompute FLOPs whose modelled peak fits, exactly (a multiple-choice
knapsack by dynamic programming over the bytes to save, in `GRANULE` units, each block's saving
rounded down). The memory estimator (`scripts/estimate_memory.py --plan`) measures the chosen
plan's real peak on fake tensors and re-solves with a tighter target where the model was
short; the trainer runs it at startup (`ac_auto.py`).

Recompute FLOPs become time at one throughput (`auto_tflops`), so the FLOPs alone decide; the
host cost of op-SAC's per-op dispatch is not modelled (see docs/activation_checkpointing.md).
"""

import json
from dataclasses import asdict, dataclass

import numpy as np

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.activation_checkpoint import BLOCK_CHOICES, format_block_plan

GiB = 2**30
# The planner's unit of memory: savings are counted in whole MiB, rounded down.
GRANULE = 2**20


@dataclass(frozen=True)
class BlockCost:
    """One block's measurements, per choice.

    Attributes:
        index: the block's index in the whole model.
        held: bytes one forward of the block holds for backward.
        flops: FLOPs the step runs in the block (forward, recompute and backward), all
            micro-batches included.
    """

    index: int
    held: dict[str, int]
    flops: dict[str, int]

    def saving(self, choice: str) -> int:
        """Bytes `choice` holds less than no AC, per forward in flight (never negative)."""
        return max(0, self.held["none"] - self.held[choice])

    def recompute_flops(self, choice: str) -> int:
        """FLOPs a step spends recomputing this block under `choice`."""
        return max(0, self.flops[choice] - self.flops["none"])


@dataclass(frozen=True)
class RankCosts:
    """The measurements of one device's blocks: `peak[choice]` is the step's peak with every
    block at `choice`; `label` names the device ("" for the whole model, "pp 1", ...)."""

    label: str
    peak: dict[str, int]
    blocks: tuple[BlockCost, ...]

    def in_flight(self) -> float:
        """How many forwards' worth of held bytes the no-AC peak holds at once, measured: the
        drop from no AC to full AC over what full AC saves per forward. 1 without pipelining;
        about the microbatches in flight on a pipeline rank."""
        per_forward = sum(block.saving("full") for block in self.blocks)
        if per_forward <= 0:
            return 1.0
        return max(1.0, (self.peak["none"] - self.peak["full"]) / per_forward)

    def estimated_peak(self, choices: dict[int, str]) -> int:
        """The modelled step peak of `choices` (block index -> choice)."""
        saved = sum(block.saving(choices[block.index]) for block in self.blocks)
        return max(self.peak["full"], round(self.peak["none"] - self.in_flight() * saved))

    def recompute_flops(self, choices: dict[int, str]) -> int:
        return sum(block.recompute_flops(choices[block.index]) for block in self.blocks)


class NothingFits(ConfigError):
    """The budget is below what full AC on every block of some device needs."""


def solve(costs: RankCosts, budget: int) -> dict[int, str]:
    """The choices for `costs.blocks` with the least recompute FLOPs whose modelled peak
    (`RankCosts.estimated_peak`) is at most `budget` bytes. Ties go to the choice listed first
    in `BLOCK_CHOICES` (the least recompute), block by block, so equal inputs give equal plans.

    Raises:
        NothingFits: when even full AC on every block is modelled above `budget`.
    """
    if costs.peak["full"] > budget:
        raise NothingFits(_nothing_fits(costs, budget))
    scale = costs.in_flight()
    need = costs.peak["none"] - budget
    # Whole units of saving needed; a block's saving counts in whole units, rounded down, so a
    # plan that reaches `target` units fits.
    target = max(0, -(-need // GRANULE))
    blocks = costs.blocks
    units = [[int(scale * block.saving(c)) // GRANULE for c in BLOCK_CHOICES] for block in blocks]
    cost = [[block.recompute_flops(c) for c in BLOCK_CHOICES] for block in blocks]
    if sum(max(u) for u in units) < target:
        # Rounding down lost the last unit: every block at its largest saving, which the
        # full-AC check above proved fits.
        return {block.index: "full" for block in blocks}
    # best[t]: the least FLOPs to save at least t units with the blocks seen so far.
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


def _nothing_fits(costs: RankCosts, budget: int) -> str:
    where = f" on {costs.label}" if costs.label else ""
    return (
        f"mode 'auto' cannot fit its budget of {budget / GiB:.2f} GiB per device "
        f"('activation_checkpoint.auto_memory_gib'): full AC on every block needs {costs.peak['full'] / GiB:.2f} GiB per device{where} (estimated). Give "
        "more memory, or hold less per device: a larger tensor_parallel_degree, "
        "pipeline_parallel_degree or context_parallel_degree, more FSDP ranks, or a smaller "
        "training.local_batch_size."
    )


@dataclass
class BlockPlan:
    """A solved plan: the choice per block, and per device group its modelled and measured
    peaks and recompute FLOPs per step.

    Attributes:
        choices: block index -> choice.
        budget: the bytes it was planned for.
        ranks: per device label, {"estimated", "measured", "recompute_flops", "full_flops_recompute"}.
        held: block index -> choice -> bytes held per forward (for the table).
        recompute: block index -> choice -> recompute FLOPs per step (for the table).
        fingerprint: what the plan was made for (`ac_auto.layout_fingerprint`).
    """

    choices: dict[int, str]
    budget: int
    ranks: dict[str, dict[str, int]]
    held: dict[int, dict[str, int]]
    recompute: dict[int, dict[str, int]]
    fingerprint: str = ""

    @property
    def spec(self) -> str:
        """The `auto_plan` string."""
        return format_block_plan(self.choices)

    def table(self, tflops: float) -> str:
        """A Markdown table: per block its choice, the bytes it holds for backward per forward,
        and its recompute per step in ms at `tflops` TFLOP/s; then one line per device."""
        lines = [
            "| block | choice | held per forward, MiB | recompute per step, GFLOP | recompute per step, ms |",
            "|---|---|---|---|---|",
        ]
        for index in sorted(self.choices):
            choice = self.choices[index]
            flops = self.recompute[index][choice]
            lines.append(
                f"| {index} | {choice} | {self.held[index][choice] / 2**20:.1f} | {flops / 1e9:.2f} | "
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
            held=ints(raw["held"]), recompute=ints(raw["recompute"]), fingerprint=raw.get("fingerprint", ""),
        )  # fmt: skip
