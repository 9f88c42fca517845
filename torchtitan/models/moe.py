"""The one Mixture-of-Experts layer: token-choice top-k router, grouped SwiGLU experts, optional
shared experts, auxiliary-loss-free load balancing and the sequence-level auxiliary loss.

A model puts `MoE(dim, hidden_dim, args)` in its block under the attribute `moe`, so that the
gate's FQN ends in `moe.router.gate` (activation checkpointing recomputes that matmul by name).

Training-loop duties, both optional:
    - after each optimizer step, `update_expert_bias(model, dp_group)` when any layer sets
      `load_balance_coeff`; it returns a per-layer load-imbalance metric for logging.
    - when `seq_aux_loss_coeff > 0`, add `pop_aux_loss(model)` to the loss before backward.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.distributed.activation_checkpoint import all_to_all_input
from torchtitan.distributed.param_init import init_param_
from torchtitan.models.layers import FeedForward, trunc_normal
from torchtitan.tools.fqn import clean_fqn
from torchtitan.tools.grouped_mm import grouped_mm_supported


@dataclass
class MoEArgs:
    """Hyperparameters of one MoE layer.

    Attributes:
        num_experts: routed experts per layer.
        num_shared_experts: experts every token passes through (0 = none); they form one SwiGLU
            of width `hidden_dim * num_shared_experts`.
        top_k: experts each token is routed to.
        score_func: "softmax" over all experts (Qwen3) or per-expert "sigmoid" (DeepSeek-V3).
        route_norm: renormalize each token's top-k scores to sum to 1 (before `route_scale`).
        route_scale: multiplies the combine weights.
        num_expert_groups, num_limited_groups: node-limited routing (DeepSeek-V3): experts form
            `num_expert_groups` equal groups; a token may use only the `num_limited_groups`
            groups with the largest sum of their top-2 scores. None on both disables it.
        load_balance_coeff: update rate of auxiliary-loss-free balancing (the expert bias);
            None disables it.
        seq_aux_loss_coeff: weight of the sequence-level balance loss; 0 disables it.
        use_grouped_mm: run the experts with `torch._grouped_mm` where it is supported.
        force_load_balance: a benchmarking aid (`model.moe_force_load_balance`): route token t
            to experts t*k, ..., t*k + k-1 (mod num_experts) whatever the scores, so that every
            expert gets the same number of tokens; the combine weights are still the scores of
            those experts, so the router keeps its gradient.
    """

    num_experts: int = 8
    num_shared_experts: int = 0
    top_k: int = 2
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    load_balance_coeff: float | None = None
    seq_aux_loss_coeff: float = 0.0
    use_grouped_mm: bool = True
    force_load_balance: bool = False

    def __post_init__(self):
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func '{self.score_func}' is unknown; use 'softmax' or 'sigmoid'")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k = {self.top_k} must be in [1, num_experts = {self.num_experts}]")
        if (self.num_expert_groups is None) != (self.num_limited_groups is None):
            raise ValueError("set both num_expert_groups and num_limited_groups, or neither")
        if self.num_expert_groups is not None:
            self._check_groups()

    def _check_groups(self) -> None:
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if groups < 1 or self.num_experts % groups:
            raise ValueError(f"num_experts = {self.num_experts} is not divisible into {groups} groups")
        if not 1 <= limited <= groups:
            raise ValueError(f"num_limited_groups = {limited} must be in [1, num_expert_groups = {groups}]")
        if self.top_k > limited * (self.num_experts // groups):
            raise ValueError(f"top_k = {self.top_k} exceeds the experts of {limited} groups")


def _local(t: torch.Tensor) -> torch.Tensor:
    # Tensor/expert parallelism hand the experts DTensor weights; the math runs on local shards.
    return t.to_local() if isinstance(t, DTensor) else t


def _in_backward() -> bool:
    # Activation checkpointing reruns forward inside backward; side effects must happen once.
    # A compiled block never reruns Python in backward (its recompute is in the compiled
    # backward graph), so under compile the side effects always belong to the forward.
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class TokenChoiceTopKRouter(nn.Module):
    """Scores every expert for each token and picks each token's `top_k` experts.

    Args:
        dim: token width.
        args: the layer's `MoEArgs`.
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.args = args

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None, return_scores: bool = False):
        """Route tokens `x` [T, dim]: scores are the softmax or sigmoid, in fp32, of the gate's
        logits (which come out in the gate weight's dtype).

        Args:
            x: tokens, [T, dim].
            expert_bias: [num_experts] added to the scores only to choose experts (load
                balancing); the combine weights never include it.
            return_scores: also return the fp32 scores of all experts, [T, num_experts].

        Returns:
            (top_scores [T, k] fp32 combine weights, selected_experts [T, k] int64,
            num_tokens_per_expert [num_experts] int64) and, with `return_scores`, the scores.

        Pitfall: selection goes through `torch.topk` and the counts through `scatter_add`, whose
        outputs every AC mode saves for MoE blocks, so a recompute replays the forward's routing
        even where scores tie or the expert bias changed in between. With `force_load_balance`
        the expert bias and the group limit play no part in the choice.
        """
        scores = self._score(self.gate(x).float())
        if self.args.force_load_balance:
            selected = self._round_robin(scores.shape[0], scores.device)
        else:
            selected = self._top_k(scores, expert_bias)
        top_scores = scores.gather(-1, selected)
        if self.args.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.args.route_scale
        counts = _count_per_expert(selected, self.args.num_experts)
        return (top_scores, selected, counts, scores) if return_scores else (top_scores, selected, counts)

    def _top_k(self, scores: torch.Tensor, expert_bias: torch.Tensor | None) -> torch.Tensor:
        choice = scores if expert_bias is None else scores + expert_bias
        if self.args.num_expert_groups is not None:
            choice = self._mask_unpicked_groups(choice)
        return torch.topk(choice, self.args.top_k, dim=-1).indices

    def _round_robin(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """[T, k] experts dealt in turn: k consecutive slots, distinct experts since k <= E."""
        slots = torch.arange(num_tokens * self.args.top_k, device=device).view(num_tokens, -1)
        return slots % self.args.num_experts

    def _score(self, logits: torch.Tensor) -> torch.Tensor:
        if self.args.score_func == "softmax":
            return F.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def _mask_unpicked_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [T, E] with -inf outside each token's `num_limited_groups` best groups, a
        group ranking by the sum of its two best scores (its one score for 1-expert groups)."""
        groups = choice.view(choice.shape[0], self.args.num_expert_groups, -1)
        group_score = torch.topk(groups, min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_score, self.args.num_limited_groups, dim=-1).indices
        dropped = torch.ones_like(group_score, dtype=torch.bool).scatter(1, kept, False)
        return groups.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(1)

    def init_weights(self, init_std: float) -> None:
        init_param_(self.gate.weight, trunc_normal(init_std))


def _count_per_expert(selected: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (a bincount), int64 [num_experts].

    A scatter-add rather than `torch.bincount`: its output size is static, so it runs under
    FakeTensorMode (memory estimation) and compile, and it is deterministic on accelerators.
    """
    flat = selected.flatten()
    # Out of place: activation checkpointing saves this op's output (routing replay), which an
    # in-place op would not give back to the tensor it mutates.
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add(
        0, flat, torch.ones_like(flat)
    )


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's when it is on (the trainer autocasts
    without FSDP), since `torch._grouped_mm` has no autocast kernel and would run in x's fp32
    while every Linear runs in bf16; otherwise x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with stacked weights, run on tokens grouped by expert.

    w1, w3: [num_experts, hidden_dim, dim]; w2: [num_experts, dim, hidden_dim] (each expert's
    slice is laid out like an nn.Linear weight). Two implementations with the same math:
    one `torch._grouped_mm` call per projection, or a loop of per-expert matmuls; the first is
    used when `use_grouped_mm` is set and `uses_grouped_mm(x)` allows it.
    """

    # Rows per expert are padded to this multiple for grouped mm: the weight-gradient matmul
    # splits the token dimension at group offsets, which need 16-byte alignment (8 bf16 rows).
    # Low-precision (fp8, mxfp8) grouped matmuls need 16 or 32: override on the class.
    align_rows: int = 8

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, ...)` takes the grouped-mm path: it is enabled, the op runs for
        x's device and dtype, and the (local) dim and hidden_dim rows are 16-byte aligned."""
        if not self.use_grouped_mm:
            return False
        row_bytes = [n * x.element_size() for n in _local(self.w1).shape[1:]]
        return all(b % 16 == 0 for b in row_bytes) and grouped_mm_supported(x.device, x.dtype)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Apply expert e to its rows of `x`.

        Args:
            x: [N, dim], rows grouped by expert: expert 0's first, then expert 1's, and so on.
            num_tokens_per_expert: [num_experts] integer row counts, summing to N.

        Returns:
            [N, dim], row i computed by the expert that owns row i.

        Pitfalls: the loop path reads the counts on the host (one device sync per call). The
        grouped-mm path's padding rows hold whatever memory held, NaN included, so
        `torch.autograd.set_detect_anomaly(True)` reports NaN in their gradients although no
        result reads them; set `use_grouped_mm = False` on the experts to debug with it.
        """
        dtype = _matmul_dtype(x)
        x = x.to(dtype)
        # A no-op unless FSDP's mixed precision left these weights alone (expert parallelism
        # keeps them out of FSDP) or autocast runs the matmuls in a lower precision.
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        if self.uses_grouped_mm(x):
            return self._grouped(x, num_tokens_per_expert, w1, w2, w3)
        return self._looped(x, num_tokens_per_expert, w1, w2, w3)

    def _looped(self, x, counts, w1, w2, w3) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            h = F.silu(rows @ w1[e].transpose(0, 1)) * (rows @ w3[e].transpose(0, 1))
            with all_to_all_input():
                outs.append(h @ w2[e].transpose(0, 1))
        return torch.cat(outs)

    def _grouped(self, x, counts, w1, w2, w3) -> torch.Tensor:
        dest, padded_counts = _aligned_rows(counts, x.shape[0], self.align_rows)
        # Static worst-case size (no device sync). Grouped mm leaves output rows past the last
        # offset unwritten; only elementwise ops touch them, and nothing reaches the results.
        padded = x.new_zeros(x.shape[0] + counts.numel() * self.align_rows, x.shape[1])
        padded[dest] = x
        offs = torch.cumsum(padded_counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(padded, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(padded, w3.transpose(-2, -1), offs=offs)
        # Under expert parallelism only the combine all-to-all reads w2's output.
        with all_to_all_input():
            out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        return out[dest]

    def init_weights(self, init_std: float) -> None:
        init_param_(self.w1, trunc_normal(0.02))
        init_param_(self.w2, trunc_normal(init_std))
        init_param_(self.w3, trunc_normal(init_std))


def is_expert_matmul(func, args) -> bool:
    """Whether an op seen by a `TorchDispatchMode` is a `GroupedExperts` matmul: a grouped mm,
    or on the loop path an `mm` whose right operand is a view of one expert's slice of a stacked
    3-D weight. For instruments that count expert work (tests, benchmarks), on either path."""
    if func is torch.ops.aten._grouped_mm.default:
        return True
    if func is not torch.ops.aten.mm.default:
        return False
    base = args[1]._base
    return base is not None and base.dim() == 3


def _aligned_rows(counts: torch.Tensor, num_rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of `num_rows` expert-grouped rows goes once every group is padded to `align`.

    Returns:
        (dest [num_rows]: each row's index in the padded batch, padded_counts [E]).

    Empty experts also get `align` zero rows, so that every group's weight gradient is a real
    (zero) matmul. All shapes are static: no device sync.
    """
    padded_counts = ((counts + align - 1) // align * align).clamp_min(align)
    start = torch.cumsum(counts, dim=0) - counts
    padded_start = torch.cumsum(padded_counts, dim=0) - padded_counts
    rows = torch.arange(num_rows, device=counts.device)
    expert = torch.searchsorted(torch.cumsum(counts, dim=0), rows, right=True)
    return padded_start[expert] + rows - start[expert], padded_counts


class MoE(nn.Module):
    """Token-choice top-k Mixture of Experts with optional shared experts.

    Args:
        dim: token width.
        hidden_dim: width of each routed expert; the shared experts are `num_shared_experts`
            times as wide.
        args: `MoEArgs`.

    Buffers (fp32; keep them so: `model.to(bfloat16)` would make counts inexact and bias
    updates vanish):
        expert_bias [num_experts], persistent: added to scores to choose experts.
        tokens_per_expert [num_experts], not persistent: tokens routed since the last
            `update_expert_bias`.

    `aux_loss` is the sequence-level balance loss of the latest forward (already multiplied
    by `seq_aux_loss_coeff`), or None when the coefficient is 0; see `pop_aux_loss`.
    """

    def __init__(self, dim: int, hidden_dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.num_experts = args.num_experts
        self.load_balance_coeff = args.load_balance_coeff
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * args.num_shared_experts) if args.num_shared_experts else None
        )
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False
        )
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix experts over `x` [batch, seq, dim]; returns [batch, seq, dim] in x's dtype.

        Side effects, in training mode only (validation must not steer the load balancing)
        and skipped in an activation-checkpoint recompute so that they happen once per step:
        adds the routed counts to `tokens_per_expert`; sets `aux_loss`.
        """
        batch, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if self.load_balance_coeff is not None else None
        want_aux = self.args.seq_aux_loss_coeff > 0
        top_scores, selected, counts, *scores = self.router(tokens, bias, return_scores=want_aux)
        # Computed in recompute too: skipping it would change the number of saved tensors.
        aux = self._sequence_aux_loss(scores[0], selected, batch) if want_aux else None
        if self.training and not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
            if aux is not None:  # no Python attribute write, so no side effect for dynamo, by default
                self.aux_loss = aux
        routed = self._run_experts(tokens, selected, counts)
        # Weighting in fp32 keeps bf16 rounding out of the sum over the k experts.
        out = (routed.view(-1, self.args.top_k, dim).float() * top_scores.unsqueeze(-1)).sum(dim=1)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(batch, seq_len, dim)

    def _run_experts(self, tokens: torch.Tensor, selected: torch.Tensor, counts: torch.Tensor):
        """Expert outputs [T * k, dim], row t * k + j for token t's j-th selected expert."""
        # Stable, so each expert sees its tokens in token order whatever the sort kernel.
        order = torch.argsort(selected.flatten(), stable=True)
        routed_sorted = self.experts(tokens[order // self.args.top_k], counts)
        routed = torch.empty_like(routed_sorted)
        routed[order] = routed_sorted
        return routed

    def _sequence_aux_loss(self, scores: torch.Tensor, selected: torch.Tensor, batch: int) -> torch.Tensor:
        """DeepSeek-V3's complementary sequence-wise balance loss, times its coefficient.

        Per sequence: coeff * sum_i f_i * P_i, with f_i = E / (k * S) * (tokens routed to i)
        and P_i the mean over tokens of the scores normalized to sum 1 per token; averaged
        over the batch. Only P carries gradient (into the gate).
        """
        num_experts, top_k = self.num_experts, self.args.top_k
        probs = scores / scores.sum(dim=-1, keepdim=True)
        seq_len = probs.shape[0] // batch
        mean_probs = probs.view(batch, seq_len, num_experts).mean(dim=1)
        seq_of_slot = torch.arange(batch, device=selected.device).repeat_interleave(seq_len * top_k)
        hits = _count_per_expert(seq_of_slot * num_experts + selected.flatten(), batch * num_experts)
        load = hits.view(batch, num_experts).float() * (num_experts / (top_k * seq_len))
        return self.args.seq_aux_loss_coeff * (load * mean_probs).sum(dim=-1).mean()

    def init_weights(self, init_std: float) -> None:
        """Fill parameters and zero the buffers in place (after `to_empty`), same for any layout.

        Args:
            init_std: std of the gate and of the output-side expert projections (w2, w3).
        """
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        init_param_(self.expert_bias, nn.init.zeros_)
        init_param_(self.tokens_per_expert, nn.init.zeros_)
        self.aux_loss = None


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(clean_fqn(name), module) for name, module in model.named_modules() if isinstance(module, MoE)]


@torch.no_grad()
def update_expert_bias(
    model: nn.Module, dp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Auxiliary-loss-free load balancing: nudge every MoE layer's expert bias toward its
    underloaded experts, then start counting afresh. Call after each optimizer step.

    For a layer with `load_balance_coeff` c and counts n: `expert_bias += d - mean(d)` with
    `d = c * sign(mean(n) - n)`. Layers without a coefficient only have their counts reset.

    Args:
        model: any module tree holding `MoE` layers.
        dp_group: the group whose ranks see different tokens (data parallel, and context
            parallel if any); counts are summed over it, in one collective for all layers.

    Returns:
        {layer FQN: tokens per expert [num_experts]}, counted over `dp_group`, on the device so
        that the step does not wait for the host; read them at log time.

    Pitfall: every rank of `dp_group` must call this at the same step, or the collective hangs.
    """
    layers = _moe_layers(model)
    if not layers:
        return {}
    counts = torch.cat([m.tokens_per_expert for _, m in layers])
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    per_layer = counts.split([m.num_experts for _, m in layers])
    for (_, moe), n in zip(layers, per_layer):
        if moe.load_balance_coeff is not None:
            delta = moe.load_balance_coeff * torch.sign(n.mean() - n)
            moe.expert_bias.add_(delta - delta.mean())
        moe.tokens_per_expert.zero_()
    return dict(zip([name for name, _ in layers], per_layer))


def _worst_max_over_mean(loads: list[torch.Tensor]) -> torch.Tensor:
    """max / mean of each load vector (1.0 when balanced), the largest over the vectors.

    Run every step: vectors of one length (every MoE layer of a model, as a rule) take a
    handful of kernels together rather than four per layer."""
    if len({n.numel() for n in loads}) == 1:
        stacked = torch.stack(loads)
        return (stacked.amax(dim=1) / stacked.mean(dim=1).clamp_min(1e-9)).max()
    return torch.stack([n.max() / n.mean().clamp_min(1e-9) for n in loads]).max()


def load_balance_step(model: nn.Module, dp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """`update_expert_bias`, summarized for the step log:
    - `moe_imbalance`: the worst layer's max / mean tokens per expert;
    - `moe_ep_imbalance`, under expert parallelism only: the worst layer's max / mean routed
      rows per EP rank (the sum over the rank's experts). It is what the memory estimator's
      `--ep-imbalance` asks for, exactly when the EP group spans all of `dp_group`.

    The signature of a TrainSpec's `post_optimizer_step_fn`; returns {} for a dense model.
    """
    counts = update_expert_bias(model, dp_group)
    if not counts:
        return {}
    metrics = {"moe_imbalance": _worst_max_over_mean(list(counts.values()))}
    per_rank = []
    for name, moe in _moe_layers(model):
        ep = moe.num_experts // moe.experts.num_experts
        if ep > 1:
            per_rank.append(counts[name].view(ep, -1).sum(dim=1))
    if per_rank:
        metrics["moe_ep_imbalance"] = _worst_max_over_mean(per_rank)
    return metrics


def pop_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the MoE layers' `aux_loss` from the latest forward, clearing them; None if none.

    Add it to the training loss before backward, scaled like that loss under gradient
    accumulation. Clearing lets the loss graph go with the step. Pitfall: with pipeline
    parallelism each stage holds only its own layers' losses.
    """
    losses = []
    for _, moe in _moe_layers(model):
        if moe.aux_loss is not None:
            losses.append(moe.aux_loss)
            moe.aux_loss = None
    return torch.stack(losses).sum() if losses else None
