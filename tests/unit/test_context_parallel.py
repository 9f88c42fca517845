"""Context parallelism in one process: which tokens a rank holds, what the model reads at them,
and the layouts refused. Its parity with one process over 2 ranks is test_layout_parity.py's,
and its collectives under each AC mode test_parallelism.py's."""

import pytest
import torch

from torchtitan.config import ConfigError, parse_args
from torchtitan.distributed import context_parallel
from torchtitan.distributed.context_parallel import ContextParallel, check_context_parallel, token_positions
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3 import llama3_flavors


def test_headtail_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert token_positions(8, 2, 0, "headtail") == [0, 1, 6, 7]
    assert token_positions(8, 2, 1, "headtail") == [2, 3, 4, 5]


def test_without_a_balancer_each_rank_holds_one_contiguous_chunk():
    assert token_positions(8, 2, 1, "none") == [4, 5, 6, 7]


@pytest.mark.parametrize("balancer", ["headtail", "none"])
def test_the_ranks_hold_every_position_once(balancer):
    held = sorted(p for rank in range(4) for p in token_positions(64, 4, rank, balancer))
    assert held == list(range(64))


def test_headtail_gives_every_rank_the_same_causal_attention_work():
    """Keys a query at position p sees under a causal mask: p + 1."""
    work = [sum(p + 1 for p in token_positions(64, 4, rank, "headtail")) for rank in range(4)]
    contiguous = [sum(p + 1 for p in token_positions(64, 4, rank, "none")) for rank in range(4)]
    assert len(set(work)) == 1
    assert max(contiguous) > 6 * min(contiguous)


def _plan(method: str = "allgather_kv", rank: int = 1) -> ContextParallel:
    return ContextParallel(2, rank, group=None, method=method)


def test_a_rank_runs_on_its_tokens_and_reads_rope_and_masks_at_their_positions():
    tokens, labels = torch.arange(8)[None], torch.arange(1, 9)[None]
    rope = torch.arange(8)[:, None]
    with _plan().sharded(tokens, labels) as (local_tokens, local_labels):
        assert local_tokens.tolist() == [[2, 3, 4, 5]] and local_labels.tolist() == [[3, 4, 5, 6]]
        assert context_parallel.rope_rows(rope).flatten().tolist() == [2, 3, 4, 5]
        assert context_parallel.tokens_for_masks(local_tokens) is tokens
        assert context_parallel.active_step().gathered_positions.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert context_parallel.active_step() is None
    assert context_parallel.rope_rows(rope) is rope


def _check(*argv: str, dims: ParallelDims | None = None):
    cfg = parse_args(
        ["--training.seq_len", "64", "--parallelism.context_parallel_degree", "2", *argv], env={}
    )
    check_context_parallel(cfg, llama3_flavors["debugmodel"], dims or ParallelDims(1, 1, 1, 2, cp=2))


@pytest.mark.parametrize(
    "argv, dims, message",
    [
        (["--training.seq_len", "62"], None, "'training.seq_len' = 62 does not split into 4 equal chunks"),
        (["--parallelism.context_parallel_method", "ulysses", "--parallelism.tensor_parallel_degree", "16"],
         ParallelDims(1, 1, 16, 32, cp=2), "splits the 1 attention heads per tensor-parallel rank"),
    ],
    ids=["sequence", "ulysses-heads"],
)  # fmt: skip
def test_a_layout_context_parallelism_cannot_run_is_refused_naming_the_key(argv, dims, message):
    with pytest.raises(ConfigError, match=message):
        _check(*argv, dims=dims)


def test_a_sequence_of_cp_chunks_is_enough_without_the_balancer():
    _check("--training.seq_len", "62", "--parallelism.context_parallel_load_balancer", "none")


@pytest.mark.parametrize("method", ["allgather_kv", "ulysses"])
@pytest.mark.parametrize("mask_type", ["causal", "block_causal", "sliding_window", "chunked"])
def test_the_mask_mod_a_gpu_builds_its_block_mask_from_allows_what_the_dense_mask_does(method, mask_type):
    """On a GPU the masks read at a rank's positions are flex block masks built from their mask
    mod; on the CPU the dense mask's rows and columns are picked. Both must allow the same."""
    from torch.nn.attention.flex_attention import create_mask

    from torchtitan.models.attention import build_attention_masks, masks_under_context_parallel

    tokens = torch.randint(0, 4, (2, 16), generator=torch.Generator().manual_seed(0))
    whole = build_attention_masks(tokens, mask_type, eos_id=0, sliding_window=5, chunk_size=4)
    with _plan(method).sharded(tokens, tokens) as _:
        (read,) = masks_under_context_parallel([whole])
    rows, cols = read.dense_mask.shape[-2:]
    batch = 2 if mask_type == "block_causal" else None
    assert torch.equal(create_mask(read.mask_mod, batch, None, rows, cols), read.dense_mask)
    assert (rows, cols) == ((8, 16) if method == "allgather_kv" else (16, 16))
