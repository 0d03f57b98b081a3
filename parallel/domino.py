"""Domino (Wang et al., DeepSpeed-Domino): a schedule that hides tensor
parallelism's communication behind computation.

The micro-batch is split along the batch into chunks that are independent
until the loss. The layer stack is a list of sublayers (a transformer block
has two: attention and MLP), and a chunk's pass through a sublayer is

    enter:  wait for its previous row-parallel all-reduce, residual add,
            LayerNorm, and the node where backward will wait (see below)
    body:   column-parallel GEMM ... (heads or GeLU), row-parallel GEMM
    launch: the row-parallel all-reduce, left in flight

Forward: chunk i's all-reduce is in flight while the other chunks' bodies
run, and is waited for only when chunk i enters its next sublayer.

Backward runs the graph in reverse, always picking the ready node that was
created LAST in forward. The column-parallel layer launches its dX
all-reduce and returns without waiting (DeferredCollectives); the wait is
an identity node made when the chunk entered the sublayer. Each chunk
therefore enters its sublayer BEFORE the previous chunk launches its
row-parallel GEMM: in backward, that GEMM's gradients are computed between
this chunk's launch and its wait. With 2 chunks:

    forward   body0 | enter1 | row0 | body1 | enter0' | row1 | body0' ...
    backward  ... row1' | body1'[launch 1] | row0' | wait 1 | ...

Under sequence parallelism (each chunk holds this rank's T/tp tokens) each
all-reduce is a reduce-scatter, in flight the same way, and entering a
sublayer also launches the all-gather of the chunk's LayerNorm output,
which the column-parallel GEMM waits for: the previous chunk's row GEMM runs
meanwhile. In backward the dX reduce-scatter is deferred like the
all-reduce; the all-gathers of a row-parallel layer's dY are not (its GEMMs
need them at once).

tests/test_parallel.py records this order on two ranks and checks it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from .mappings import DeferredCollectives


class Sublayer(NamedTuple):
    norm: nn.Module   # the LayerNorm that enters it
    body: Callable    # body(h, deferred, chunk index) -> the row-parallel layer's input
    row: nn.Module    # the RowParallelLinear that ends it (forward_async)
    dropout: nn.Module


def _finish_branch(pending):
    """dropout(all-reduced branch output), waiting for the all-reduce only now."""
    if pending is None:
        return None
    reduce, drop = pending
    return drop(reduce.wait())


def domino(sublayers: list[Sublayer], chunks: list[torch.Tensor], add_and_norm: Callable,
           sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Run every chunk (b, T, C) through every sublayer, interleaved as the
    module docstring says; return the chunks' outputs. add_and_norm(norm, x,
    branch) -> (x + branch, norm(x + branch)) is the model's residual add and
    LayerNorm (branch None: no add)."""
    chunks = list(chunks)
    pending = [None] * len(chunks)   # per chunk: (in-flight all-reduce, its dropout)

    def enter(i, s):  # -> (LayerNorm output (b, T, C), where its grad is awaited)
        chunks[i], h = add_and_norm(sublayers[s].norm, chunks[i], _finish_branch(pending[i]))
        deferred = DeferredCollectives()
        if sequence_parallel:  # h holds this rank's tokens: start gathering them all now
            deferred.gather_input(h)
        return deferred.wait_in_backward(h), deferred

    entered = [enter(0, 0)] + [None] * (len(chunks) - 1)
    for s, sublayer in enumerate(sublayers):
        for i in range(len(chunks)):
            y = sublayer.body(*entered[i], i)         # (b, T, C/tp) or (b, T, F/tp)
            if i + 1 < len(chunks):                   # the next chunk enters...
                entered[i + 1] = enter(i + 1, s)
            elif s + 1 < len(sublayers):              # ...or the first, the next sublayer
                entered[0] = enter(0, s + 1)
            pending[i] = (sublayer.row.forward_async(y), sublayer.dropout)  # ...before this row GEMM
    return [c + _finish_branch(p) for c, p in zip(chunks, pending)]
