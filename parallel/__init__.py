"""Megatron-style tensor parallelism, in small readable pieces.

Tensor parallelism (TP) splits every big matrix of a transformer layer across
the tp ranks of a tensor-parallel group (Shoeybi et al., "Megatron-LM", 2019):

    MLP:        Y = GeLU(X A) B       A split by COLUMNS, B split by ROWS
    attention:  heads split across ranks (QKV by columns, output proj by rows)

so each rank holds 1/tp of the weights and does 1/tp of the FLOPs. A
column-parallel layer followed by a row-parallel layer needs exactly two
communication operators, which Megatron calls f and g:

    f = copy_to_tensor_parallel_region       forward: identity   backward: all-reduce
    g = reduce_from_tensor_parallel_region   forward: all-reduce backward: identity

    X --f--> [X A_r] --GeLU--> [. B_r] --g--> Y      (r = this rank's shard)

Every rank sees the full X; rank r computes the partial product with its
column block A_r and row block B_r; g sums the partial products. In backward,
f sums the partial gradients w.r.t. X. That is one all-reduce per block
forward and one backward.

The embedding is split by vocabulary (VocabParallelEmbedding) and the loss is
computed on vocab-sharded logits without ever gathering them
(vocab_parallel_cross_entropy).

Layout of ranks (torchrun world of W = dp * tp ranks): tensor-parallel groups
are CONSECUTIVE ranks, so they live inside one node where the interconnect is
fastest (TP communicates every layer); data-parallel groups are the ranks with
the same TP rank. With W=8, tp=2: TP groups [0,1] [2,3] [4,5] [6,7], DP groups
[0,2,4,6] [1,3,5,7].

Domino (DeepSpeed-Domino, Wang et al. 2024) hides these all-reduces behind
computation: RowParallelLinear.forward_async launches g's all-reduce in the
background (PendingReduce.wait() collects it), so domino.py can compute one
micro-batch chunk while another chunk's result is on the wire. In backward,
ColumnParallelLinear(async_grad_allreduce=True) launches f's all-reduce
before its weight-gradient GEMM; given a DeferredCollectives it does not
even wait for it, and the wait happens in a later autograd node, so another
chunk's backward runs while the gradient is on the wire.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", 2022). Outside the f ... g pairs, tensor
parallelism leaves work replicated: every rank runs the same LayerNorms,
dropouts and residual adds on the same (B, T, C) activations, and keeps
them for backward. Sequence parallelism splits THOSE along the sequence:
rank r holds tokens [r T/tp, (r+1) T/tp). The all-reduce g becomes a
reduce-scatter (each rank keeps the sum for its tokens only), and f becomes
an all-gather (the column-parallel layer needs every token):

    x_r --LN--> --all-gather--> [X A_r] --GeLU--> [. B_r] --reduce-scatter--> y_r

An all-reduce IS a reduce-scatter followed by an all-gather, so the bytes on
the wire are the same as without it; what changes is that the activations
outside the f ... g regions are 1/tp as large. Backward swaps the two
(mappings.py). Two consequences the code must handle: replicated parameters
(norms, row-parallel biases) see only their rank's tokens, so their
gradients are summed over the TP group (grads.sum_sequence_parallel_grads);
and dropout in the split region must draw a different mask on each rank, from
a per-rank RNG stream (rng.py).

Initialization: every parallel layer first builds its FULL master weight with
the given init_method (the same on every rank when all ranks seed the RNG
identically), then keeps only its own slice. So the model is the same for any
tp; the cost is one full weight per layer held temporarily, fine for GPT-2
sizes.

Where each piece lives:

    groups.py         process groups, raw collectives (also along the
                      sequence), divisibility checks
    mappings.py       the communication operators: f, g, gathers/scatters,
                      sequence parallelism's, Domino's asynchronous ones
    rng.py            the per-rank random stream for dropout, and activation
                      checkpointing that replays it
    domino.py         Domino's schedule: chunks interleaved so that one
                      chunk's communication runs while another computes
    layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    sharding.py       slicing full tensors into shards and back; full state dicts
    cross_entropy.py  the loss on vocab-sharded logits
    grads.py          the global gradient norm and clipping; summing the
                      sequence-parallel gradients

`import parallel` gives all of them; gpt.py, train.py and the tests use
`parallel.X` and never need to know which file X lives in.
"""

from .cross_entropy import check_ids, vocab_parallel_cross_entropy
from .domino import Sublayer, domino
from .grads import clip_grad_norm_, sum_sequence_parallel_grads
from .groups import (all_gather_sequence, all_reduce, all_reduce_mean, check_divisible, destroy,
                     dp_group, dp_rank, dp_size, initialize, reduce_scatter_sequence,
                     skip_communication, tp_group, tp_rank, tp_size)
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     init_normal, sequence_parallel_off)
from .mappings import (DeferredCollectives, PendingReduce, copy_to_tensor_parallel_region,
                       gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
                       reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region)
from .rng import (checkpoint_with_rng, fork_rng_if, get_rng_tracker, model_parallel_seed,
                  rng_tracker_states_of_every_tp_rank, set_rng_tracker_states_of_every_tp_rank)
from .sharding import (full_state_dict, gather_like, gather_tensor, gather_tensor_to_first,
                       load_full_state_dict, merge_shards, shard_like, shard_tensor)

__all__ = [
    "initialize", "destroy", "tp_group", "tp_rank", "tp_size", "dp_group", "dp_rank", "dp_size",
    "check_divisible", "skip_communication", "all_reduce", "all_reduce_mean",
    "all_gather_sequence", "reduce_scatter_sequence",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "DeferredCollectives", "PendingReduce",
    "get_rng_tracker", "model_parallel_seed", "fork_rng_if", "checkpoint_with_rng",
    "rng_tracker_states_of_every_tp_rank", "set_rng_tracker_states_of_every_tp_rank",
    "sum_sequence_parallel_grads", "domino", "Sublayer",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "init_normal",
    "sequence_parallel_off",
    "shard_tensor", "merge_shards", "gather_tensor", "gather_tensor_to_first",
    "gather_like", "shard_like", "full_state_dict", "load_full_state_dict",
    "vocab_parallel_cross_entropy", "check_ids", "clip_grad_norm_",
]
