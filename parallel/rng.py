"""Random streams for tensor parallelism (Megatron's CUDA RNG tracker idea).

Every rank seeds the default generator identically (train.py), so every
rank builds the same model and draws the same dropout masks where the
tensor-parallel ranks hold the SAME values: the replicated residual stream
without sequence parallelism must stay identical on every rank.

Some dropouts act on values that differ from rank to rank:
  - attention dropout, under any tensor parallelism: each rank holds other heads;
  - hidden dropout under sequence parallelism: each rank holds other tokens.
With the shared stream those masks would be copies of each other (rank 1's
heads dropped exactly where rank 0's are). They draw from a second stream,
seeded differently on each tensor-parallel rank:

    with parallel.get_rng_tracker().fork():
        y = F.dropout(x, p)        # this rank's own mask

fork() swaps the default generator's state for the tracked one and back, so
the default stream never notices. Activation checkpointing must replay the
same masks when it recomputes a block: see checkpoint_with_rng.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .groups import tp_group, tp_rank, tp_size

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset: the tensor-parallel stream of rank r is seeded seed + 2718 + r.
MODEL_PARALLEL_SEED_OFFSET = 2718


def _current_state() -> dict:
    """The default generators' states: the CPU one, and the current GPU's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():  # call after torch.cuda.set_device (train.py does)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class RNGTracker:
    """Named generator states beside the default one; fork(name) draws from one."""

    def __init__(self):
        self._states: dict[str, dict] = {}

    def add(self, name: str, seed: int) -> None:
        """Start the stream `name` from `seed` (the default stream is untouched)."""
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if torch.cuda.is_available():  # this process's GPU only
            with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
                torch.cuda.manual_seed(seed)
                state["cuda"] = torch.cuda.get_rng_state()
        self._states[name] = state

    def get_states(self) -> dict:
        return {name: dict(state) for name, state in self._states.items()}

    def set_states(self, states: dict) -> None:
        self._states = {name: dict(state) for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream `name` inside the block, then give the default
        generator back its own state."""
        if name not in self._states:
            raise RuntimeError(f"RNG stream {name!r} was never seeded: call "
                               f"parallel.model_parallel_seed(seed) after parallel.initialize()")
        outside = _current_state()
        _set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _current_state()
            _set_state(outside)


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    return _TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed the tensor-parallel stream: seed + 2718 + this rank's TP rank, so
    TP ranks differ and data-parallel replicas agree. Call on every rank,
    after parallel.initialize(), next to torch.manual_seed(seed)."""
    _TRACKER.set_states({})
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank())


def rng_tracker_states_of_every_tp_rank() -> list[dict]:
    """Every TP rank's tracker states, in TP-rank order, for a checkpoint.
    Collective over the TP group."""
    mine = _TRACKER.get_states()
    if tp_size() == 1:
        return [mine]
    everyone = [None] * tp_size()
    dist.all_gather_object(everyone, mine, group=tp_group())
    return everyone


def set_rng_tracker_states_of_every_tp_rank(states: list[dict]) -> bool:
    """Inverse: this rank takes its own. False (and nothing changes) when
    they were saved at another TP size, whose streams do not map onto ours,
    or on other devices (a CPU run's streams hold no GPU state)."""
    if len(states) != tp_size() or any(s.keys() != _current_state().keys()
                                       for s in states[tp_rank()].values()):
        return False
    _TRACKER.set_states(states[tp_rank()])
    return True


def fork_rng_if(per_rank: bool):
    """fork() when `per_rank`, else nothing: the call sites read as one line."""
    return _TRACKER.fork() if per_rank else contextlib.nullcontext()


def checkpoint_with_rng(checkpoint_fn, fn, *args):
    """checkpoint_fn(fn, *args) (torch's or DeepSpeed's activation
    checkpointing), made to replay the tracker's streams too.

    Checkpointing recomputes fn in backward, and restores the DEFAULT
    generator first so that dropout draws the same masks again. It knows
    nothing of the tracker, whose streams have moved on since: the masks
    drawn through fork() would differ, and the gradients would be wrong
    (silently). So remember the tracker's states at the first run, and
    during the recompute run from them, then put the current ones back.
    """
    start = _TRACKER.get_states()
    runs = []

    def run(*inputs):
        if not runs:                     # the forward pass
            runs.append(True)
            return fn(*inputs)
        now = _TRACKER.get_states()      # the recompute, in backward
        _TRACKER.set_states(start)
        try:
            return fn(*inputs)
        finally:
            _TRACKER.set_states(now)
    return checkpoint_fn(run, *args)
