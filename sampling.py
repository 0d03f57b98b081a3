"""Generation from a GPT: a KV cache, top-k / top-p filtering, generate().

    from sampling import generate
    ids = generate(model, prompt_ids, max_new_tokens=100, temperature=0.8, top_k=50)

The prompt runs once through GPT.forward(kv_cache=...), which fills each
layer's KVCache; every new token then runs alone against the cache. Used by
train.py's end-of-run sample and evaluate.py --task GENERATE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import parallel
from gpt import GPT


class KVCache:
    """The keys and values of every position generate() has run, per layer,
    so that each new token costs one position of compute and attention over
    the cache, not a re-run of the whole prefix. The buffers, (B, G_local,
    max_len, hd) per layer (G_local: this rank's key/value heads under TP),
    are allocated at the first call and filled in place."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0    # positions cached, in every layer (GPT.forward advances it)
        self.buffers = {}  # layer -> (K, V)

    def extend(self, layer: int, k, v):
        """Write k, v (B, G, T, hd) at positions length .. length + T - 1 of
        `layer`; return the keys and values of positions 0 .. length + T - 1."""
        if layer not in self.buffers:
            B, G, _, hd = k.shape
            self.buffers[layer] = tuple(t.new_empty(B, G, self.max_len, hd) for t in (k, v))
        K, V = self.buffers[layer]
        end = self.length + k.shape[2]
        K[:, :, self.length:end] = k
        V[:, :, self.length:end] = v
        return K[:, :, :end], V[:, :, :end]                # (B, G, end, hd) each


@torch.no_grad()
def generate(model: GPT, input_ids, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True):
    """Autoregressively extend input_ids (B, T) by up to max_new_tokens.

    temperature 0 means greedy. Only real token ids (< vocab_size) are ever
    produced. Rows that emitted eos_token_id keep emitting it; generation
    stops early once every row has. Runs in eval mode (restored after).
    With use_cache the prompt runs once and every new token then runs alone
    against a KVCache. Once the sequence outgrows the model's positions,
    each step re-runs the last max_position_embeddings tokens instead (the
    window slides, so cached keys would sit at the wrong positions).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    max_pos = model.config.max_position_embeddings
    try:
        # Every token runs on every rank: a sequence growing one token at a
        # time cannot be split over the TP ranks by sequence parallelism.
        with parallel.sequence_parallel_off(model):
            ids, unseen = input_ids, input_ids  # unseen: the tokens the cache does not hold yet
            cache = KVCache(max_pos) if use_cache else None
            finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            for _ in range(max_new_tokens):
                if cache is not None and cache.length + unseen.shape[1] <= max_pos:
                    logits = model(unseen, kv_cache=cache)
                else:
                    cache = None
                    logits = model(ids[:, -max_pos:])                  # crop to the model's window
                logits = logits[:, -1, :model.config.vocab_size].float()  # (B, V) no pad ids
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
                else:
                    logits = filter_logits(logits / temperature, top_k, top_p)
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                if eos_token_id is not None:
                    next_id = next_id.masked_fill(finished[:, None], eos_token_id)
                    finished |= next_id[:, 0] == eos_token_id
                ids, unseen = torch.cat([ids, next_id], dim=1), next_id
                if eos_token_id is not None and bool(finished.all()):
                    break
        return ids
    finally:
        model.train(was_training)


def filter_logits(logits, top_k: int | None = None, top_p: float | None = None):
    """Set logits outside the top-k / nucleus (top-p) set to -inf. logits: (B, V).

    top_p keeps the smallest set of most likely tokens whose cumulative
    probability reaches top_p; the most likely token is always kept.
    """
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = F.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        # A token is dropped once the tokens ahead of it already reach top_p;
        # mass_before of the top token is 0 < top_p, so it always survives.
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits
