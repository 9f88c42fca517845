"""Context parallelism: each sequence split over the "cp" ranks, which exchange keys and values
in attention so that every query still sees the whole sequence.

Everything but attention is per token, so each rank runs the model on its share of the tokens
(`ContextParallel.sharded`), with RoPE at their true positions and the batch's masks read at
them. Attention exchanges tensors by one of two methods:

* ``allgather_kv``: each rank all-gathers every rank's keys and values, and attends its own
  queries to the whole sequence. Per layer a rank receives the sequence's keys and values.
* ``ulysses``: an all-to-all swaps the sequence split for a split of the heads: each rank gets
  every token of 1/cp of the heads, attends the whole sequence, and a second all-to-all gives
  each rank its tokens back. Needs the heads per TP rank divisible by the degree.

Both run the same mask, read at the positions a rank holds, so any mask type works; and both
collectives are torch's functional ones, which autograd runs backwards and which op-SAC saves
(see `activation_checkpoint.context_parallel_collective`).

Load balancing: under a causal mask a late token attends to more keys than an early one. With
``headtail`` the sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r, so
every rank does the same attention work; ``none`` gives each rank one contiguous chunk.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig

# The micro-batch being run under context parallelism. A plain global, not a ContextVar:
# torch.compile cannot trace `ContextVar.get`. Only the model's top level reads it; the blocks
# get what they need with their masks.
_active: "ContextParallelStep | None" = None


def token_positions(seq_len: int, cp: int, rank: int, load_balancer: str) -> list[int]:
    """The positions, in sequence order, of the tokens rank `rank` of `cp` holds."""
    if load_balancer == "none":
        size = seq_len // cp
        return list(range(rank * size, (rank + 1) * size))
    size = seq_len // (2 * cp)
    head, tail = rank * size, (2 * cp - 1 - rank) * size
    return [*range(head, head + size), *range(tail, tail + size)]


@dataclass(frozen=True)
class ContextParallel:
    """How this run splits sequences: the degree, this rank's index, the group, the method.

    Built once by the trainer (`from_config`); `sharded` splits one micro-batch.
    """

    cp: int
    rank: int
    group: dist.ProcessGroup
    method: str = "allgather_kv"
    load_balancer: str = "headtail"

    @classmethod
    def from_config(cls, job_config: JobConfig, parallel_dims, model_args) -> "ContextParallel | None":
        """This run's context parallelism (None without it); refuses a layout it cannot run.

        Raises:
            ConfigError: naming the key to change (see `check_context_parallel`).
        """
        if not parallel_dims.cp_enabled:
            return None
        check_context_parallel(job_config, model_args, parallel_dims)
        p = job_config.parallelism
        group = parallel_dims.cp_exchange_group()
        return cls(parallel_dims.cp, parallel_dims.cp_rank(), group, p.context_parallel_method,
                   p.context_parallel_load_balancer)  # fmt: skip

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """This rank's token positions, as a tensor on `device`."""
        return torch.tensor(token_positions(seq_len, self.cp, self.rank, self.load_balancer), device=device)

    def gathered_positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of an all-gathered sequence: rank 0's tokens, then rank 1's, ..."""
        every = [token_positions(seq_len, self.cp, r, self.load_balancer) for r in range(self.cp)]
        return torch.tensor([p for positions in every for p in positions], device=device)

    @contextlib.contextmanager
    def sharded(self, inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yield this rank's share of one micro-batch, (inputs, labels) of ``[batch, seq / cp]``,
        with attention exchanging keys and values inside the block.

        The model's forward must run inside; backward may, and reads nothing of it (the
        blocks' attention gets this micro-batch's exchange with its masks).
        """
        global _active
        seq_len = inputs.shape[1]
        positions = self.positions(seq_len, inputs.device)
        outer, _active = (
            _active,
            ContextParallelStep(self, inputs, positions, self.gathered_positions(seq_len, inputs.device)),
        )
        try:
            yield inputs[:, positions], labels[:, positions]
        finally:
            _active = outer


@dataclass
class ContextParallelStep:
    """One micro-batch under context parallelism: what the model reads while it runs on it.

    Attributes:
        plan: the run's `ContextParallel`.
        full_tokens: the whole micro-batch's ids; masks that read the tokens (document
            boundaries) are built from them.
        positions: this rank's token positions.
        gathered_positions: the positions of `gather_sequence`'s output.
    """

    plan: ContextParallel
    full_tokens: torch.Tensor
    positions: torch.Tensor
    gathered_positions: torch.Tensor

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[batch, heads, tokens, dim]`` in one tensor along the tokens, in rank
        order (`gathered_positions`); its backward reduce-scatters the gradient."""
        return funcol.all_gather_single_autograd(x.contiguous(), gather_dim=2, group=self.plan.group)

    def heads_for_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, heads, tokens / cp, dim]`` -> ``[batch, heads / cp, tokens, dim]``: this rank
        gets its 1/cp of the heads for every rank's tokens (in `gathered_positions` order)."""
        cp = self.plan.cp
        b, h, s, d = x.shape
        send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
        received = funcol.all_to_all_single_autograd(send, None, None, group=self.plan.group)
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)

    def sequence_for_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `heads_for_sequence`: ``[batch, heads / cp, tokens, dim]`` ->
        ``[batch, heads, tokens / cp, dim]``."""
        cp = self.plan.cp
        b, h, s, d = x.shape
        send = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        received = funcol.all_to_all_single_autograd(send, None, None, group=self.plan.group)
        return received.transpose(0, 1).reshape(b, cp * h, s // cp, d)


def sharded_or_whole(context_parallel: ContextParallel | None, inputs: torch.Tensor, labels: torch.Tensor):
    """`context_parallel.sharded(inputs, labels)`, or, without context parallelism, a context
    that yields them as they are."""
    if context_parallel is None:
        return contextlib.nullcontext((inputs, labels))
    return context_parallel.sharded(inputs, labels)


def active_step() -> ContextParallelStep | None:
    """The micro-batch under context parallelism being run, or None."""
    return _active


def tokens_for_masks(tokens: torch.Tensor) -> torch.Tensor:
    """The ids a model builds its attention masks from: the whole sequence under context
    parallelism (document boundaries may lie on other ranks), else `tokens`."""
    step = active_step()
    return tokens if step is None else step.full_tokens


def rope_rows(rope_cache: torch.Tensor) -> torch.Tensor:
    """The RoPE cache rows of the tokens this rank holds, in their order (all positions from 0
    without context parallelism)."""
    step = active_step()
    return rope_cache if step is None else rope_cache[step.positions]


def check_context_parallel(job_config: JobConfig, model_args, parallel_dims) -> None:
    """Refuse what context parallelism cannot run, naming the key to change.

    Raises:
        ConfigError: a sequence that does not split evenly, or heads that the Ulysses method
            cannot split. (`ParallelDims` refuses the layouts CP does not run with yet.)
    """
    p, seq_len = job_config.parallelism, job_config.training.seq_len
    cp = p.context_parallel_degree
    chunks = 2 * cp if p.context_parallel_load_balancer == "headtail" else cp
    if seq_len % chunks:
        raise ConfigError(
            f"'training.seq_len' = {seq_len} does not split into {chunks} equal chunks "
            f"(context_parallel_degree {cp}, load balancer '{p.context_parallel_load_balancer}'); "
            f"use a multiple of {chunks}."
        )
    heads = model_args.n_heads // p.tensor_parallel_degree
    if p.context_parallel_method == "ulysses" and heads % cp:
        raise ConfigError(
            f"'parallelism.context_parallel_method' = 'ulysses' splits the {heads} attention heads per "
            f"tensor-parallel rank over context_parallel_degree {cp}, which does not divide them; use "
            "context_parallel_method = 'allgather_kv', or a degree that divides the heads."
        )
