r"""Zero-shot evaluation of a checkpoint (WikiText-103 perplexity, LAMBADA
accuracy), and samples from it.

    torchrun --nproc_per_node N eval_tasks.py --task WIKITEXT103 --valid-data wiki.test.tokens \
        --load CKPT [--tensor-model-parallel-size T] [--overlapping-eval 32] [--seq-length 1024]
    torchrun --nproc_per_node N eval_tasks.py --task LAMBADA --valid-data lambada_test.jsonl \
        --load CKPT [--strict-lambada]
    torchrun --nproc_per_node N eval_tasks.py --task GENERATE --load CKPT \
        (--sample-input-file prompts.txt | --num-samples 8) [--sample-output-file out.jsonl] \
        [--out-seq-length 256] [--temperature 0.8] [--top_k 50] [--top_p 0.9] [--seed 1]

The model is --load's (train.py's or DeepSpeed's checkpoints, any ZeRO stage
or tensor-parallel size) or --hf's (a Hugging Face directory); the other flags
are train.py's: the parallel layout, --seq-length, --micro-batch-size, --bf16,
--metrics-file (one JSON object). The tasks follow Megatron's
tasks/zeroshot_gpt, so the numbers compare.

  1. Data: WikiText's detokenizer and scoring windows; LAMBADA's examples.
  2. The model, from any checkpoint, in this run's layout.
  3. Scoring: one forward per micro-batch, sums all-reduced over data parallelism.
  4. The two tasks and their reports.
  5. Samples: greedy or sampled continuations with a KV cache (gpt.generate).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoint
import huggingface
import launch
import parallel
import config
from config import EVALUATE, TrainConfig, autocast, eod_token, model_config
from gpt import GPT, GPTConfig, generate
from launch import UsageError, parse_json
from prepare import load_tokenizer
from train_ops import init_processes

# ----------------------------------------------------------------------------
# 1. Data

@dataclass
class Example:
    """tokens[:-1] go in, tokens[1:] are the targets; the last `scored` count."""
    tokens: list[int]  # (n + 1,)
    scored: int


def read_text(path: str, flag: str = "--valid-data") -> str:
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({e})") from None
    if not text.strip():
        raise UsageError(f"{flag} {path}: the file is empty")
    return text


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenization (spaces around punctuation, @-@ inside
    numbers, spaced heading marks) as Megatron's zero-shot task does; the steps'
    order matters. Megatron's rule for a quote before a digit is left out: its
    pattern cannot match WikiText."""
    text = text.replace("s '", "s'")  # plural possessive: "the players '" -> "the players'"
    for sep in "-,.":  # inside numbers: "1 @,@ 000" -> "1,000", "well @-@ known" -> "well-known"
        text = text.replace(f" @{sep}@ ", sep)
    for mark in ":;.!?,":  # no space before punctuation
        text = text.replace(f" {mark} ", f"{mark} ")
    for left, right in ("()", "[]", "{}", '""', "''"):  # no space just inside brackets and quotes
        inside = rf"{re.escape(left)}\s*([^{re.escape(right)}]*?)\s*{re.escape(right)}"
        text = re.sub(inside, lambda m: left + m.group(1) + right, text)
    for n in (4, 3, 2):  # heading marks: "= = Section = =" -> "== Section =="
        text = text.replace(" ".join("=" * n), "=" * n)
    text = text.replace(" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}")
    text = text.replace(" \n", "\n").replace("\n ", "\n")  # lines start and end without a space
    text = text.replace(" N ", " 1 ")  # a number that the corpus's tokenization replaced by N
    return text.replace(" 's", "'s")


def wikitext_windows(tokens: list[int], seq_length: int, stride: int) -> list[Example]:
    """Windows of seq_length inputs every `stride` tokens (Megatron's _LMDataset):
    each scores only the targets past the end of the one before, so every
    target is scored exactly once, with seq_length - stride tokens of context."""
    last = len(tokens) - 1  # index of the last target
    windows = [Example(tokens[:seq_length + 1], min(seq_length, last))]
    done, start = windows[0].scored, stride  # targets 1..done are scored
    while done < last:
        end = min(start + seq_length, last)
        windows.append(Example(tokens[start:start + seq_length + 1], end - done))
        done, start = end, start + stride
    return windows


def lambada_split(text: str, enc, strict: bool) -> tuple[list[int], list[int]]:
    """(context, target) token ids of one LAMBADA text, as Megatron makes them:
    the target is the last BPE token, or (strict) the last word with its leading
    space after the stripped text before it."""
    if not strict:
        ids = enc.encode_ordinary(text)
        return ids[:-1], ids[-1:]
    words = text.split()
    if not words:
        return [], []
    start = text.rfind(words[-1])
    return enc.encode_ordinary(text[:start].strip()), enc.encode_ordinary(" " + words[-1])


# ----------------------------------------------------------------------------
# 2. The model

def load_model(cfg: TrainConfig, device: torch.device) -> GPT:
    """The model of --hf or --load (any kind, any layout), built in this run's
    layout: its shape from the checkpoint, how it runs (kernels, no dropout) from this run."""
    default_impl = "triton" if device.type == "cuda" else "torch"
    runtime = dict(attention_impl=cfg.attention_impl or default_impl,
                   layernorm_impl=cfg.layernorm_impl or default_impl,
                   hidden_dropout=0.0, attention_dropout=0.0, activation_checkpointing=False,
                   domino_chunks=cfg.domino_chunks if cfg.domino else 1, sequence_parallel=False)
    if cfg.hf:
        model = huggingface.from_hf(cfg.hf, **runtime)
    else:
        found = checkpoint.verified_checkpoint(cfg.load, log=launch.say)
        if found is None:
            raise UsageError(f"--load {cfg.load}: no checkpoint there (neither train.py's "
                             f"{checkpoint.LATEST} nor DeepSpeed's {checkpoint.DS_LATEST})")
        model, _ = checkpoint.saved_model(found, **runtime)
    check_model_flags(cfg, model.config)
    return model.to(device).eval()


def check_model_flags(cfg: TrainConfig, mcfg: GPTConfig) -> None:
    """Model flags are optional; given, they must describe the checkpoint's
    model. Its vocabulary must be the tokenizer's, which reads the text."""
    tokens = eod_token(cfg) + 1  # the end-of-document id is the last
    if mcfg.vocab_size != tokens:
        tokenizer = f"NullTokenizer's {cfg.vocab_size} ids and its end of document" \
            if cfg.tokenizer_type == "NullTokenizer" else "GPT-2's BPE"
        raise UsageError(f"the model's vocabulary has {mcfg.vocab_size:,} tokens, {tokenizer} "
                         f"{tokens:,}: eval_tasks.py reads text with GPT-2's BPE, or NullTokenizer "
                         f"(--tokenizer-type NullTokenizer --vocab-size N for N + 1); evaluate a model of "
                         f"another tokenizer with that tokenizer")
    if mcfg.max_position_embeddings < cfg.seq_length and cfg.task != "GENERATE":  # samples slide
        raise UsageError(f"--seq-length {cfg.seq_length} exceeds the model's "
                         f"{mcfg.max_position_embeddings} positions: pass --seq-length "
                         f"{mcfg.max_position_embeddings} or less")
    if cfg.preset is None and cfg.num_layers is None:
        return
    flags = model_config(cfg)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
        if getattr(flags, name) != getattr(mcfg, name):
            raise UsageError(f"the model flags give {name}={getattr(flags, name)}, the checkpoint's "
                             f"model has {getattr(mcfg, name)}: drop the model flags (the checkpoint "
                             f"knows its shape) or fix them")


# ----------------------------------------------------------------------------
# 3. Scoring

@torch.no_grad()
def score(model: GPT, batch: list[Example], cfg: TrainConfig, device) -> torch.Tensor:
    """[loss sum of the scored targets, their number, examples whose scored
    targets are all the greedy choice] of one micro-batch, fp64. Examples are
    right-padded (causal attention: padding changes nothing before it); every TP
    rank gets the full logits; only the true vocabulary is scored."""
    n = max(len(e.tokens) for e in batch) - 1
    tokens = torch.zeros((len(batch), n + 1), dtype=torch.long)  # padded with id 0: any id would do
    scored = torch.zeros(len(batch), n, dtype=torch.bool)
    for i, e in enumerate(batch):
        tokens[i, :len(e.tokens)] = torch.tensor(e.tokens)
        scored[i, len(e.tokens) - 1 - e.scored:len(e.tokens) - 1] = True
    tokens, scored = tokens.to(device), scored.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]                    # (B, n) each
    with autocast(cfg, device):
        logits = model(inputs)                                          # (B, n, padded vocab)
    logits = logits[..., :model.config.vocab_size].float()              # (B, n, vocab)
    loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, n)
    greedy = logits.argmax(dim=-1) == targets                           # (B, n)
    hits = (greedy | ~scored).all(dim=-1)                               # (B,)
    return torch.stack([(loss * scored).sum().double(), scored.sum().double(), hits.sum().double()])


def score_all(model: GPT, examples: list[Example], cfg: TrainConfig, device) -> tuple[float, int, int]:
    """(loss sum, targets scored, hits) over all examples: data-parallel rank r
    scores examples r, r + D, ...; the fp64 sums are all-reduced."""
    mine = examples[parallel.layout.dp_rank::parallel.layout.dp_size]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for i in range(0, len(mine), cfg.micro_batch_size):
        totals += score(model, mine[i:i + cfg.micro_batch_size], cfg, device)
    if parallel.layout.dp_size > 1:
        dist.all_reduce(totals, group=parallel.layout.dp_group)
    loss_sum, count, hits = totals.tolist()
    return loss_sum, int(count), int(hits)


# ----------------------------------------------------------------------------
# 4. The tasks

def wikitext103(cfg: TrainConfig, enc) -> tuple[list[Example], dict]:
    """The windows over the detokenized text, and what the report needs."""
    raw = read_text(cfg.valid_data)
    tokens = enc.encode_ordinary(wikitext_detokenize(raw))
    if len(tokens) < 2:
        raise UsageError(f"--valid-data {cfg.valid_data}: the text is shorter than two tokens")
    windows = wikitext_windows(tokens, cfg.seq_length, cfg.overlapping_eval or cfg.seq_length)
    # Megatron's num_original_tokens: WikiText puts one space before every word
    # and mark, so splitting the raw text on single spaces counts its own tokens.
    return windows, {"num_tokenized_tokens": len(tokens), "num_original_words": len(raw.strip().split(" ")),
                     "windows": len(windows)}


def wikitext103_results(loss_sum: float, count: int, hits: int, data: dict) -> dict:
    """Perplexity. Megatron's adjusted perplexity spreads the total loss over the
    raw text's words instead, so tokenizers compare: exp(avg_loss x token_ratio),
    token_ratio = (BPE tokens - 1) / (original words - 1) (no first target)."""
    avg_loss = loss_sum / count
    token_ratio = (data["num_tokenized_tokens"] - 1) / max(data["num_original_words"] - 1, 1)
    return {"avg_loss": avg_loss, "ppl": math.exp(avg_loss),
            "adjusted_ppl": math.exp(avg_loss * token_ratio), "tokens_scored": count,
            **data, "token_ratio": token_ratio}


def lambada(cfg: TrainConfig, enc) -> tuple[list[Example], dict]:
    """One example per line's "text" (lambada_split), and what the report needs."""
    examples = []
    for lineno, line in enumerate(read_text(cfg.valid_data).splitlines(), 1):
        if not line.strip():
            continue
        where = f"--valid-data {cfg.valid_data}:{lineno}"
        obj = parse_json(line, where, "; expected one object with \"text\" per line")
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise UsageError(f"{where}: no \"text\" string in this line; expected one object with "
                             f"\"text\" per line, e.g. {{\"text\": \"... last word\"}}")
        context, target = lambada_split(obj["text"], enc, cfg.strict_lambada)
        if not context or not target:
            raise UsageError(f"{where}: the text is shorter than two tokens (a context and a "
                             f"last word to predict)")
        if len(context) + len(target) - 1 > cfg.seq_length:
            raise UsageError(f"{where}: {len(context) + len(target)} tokens, more than --seq-length "
                             f"{cfg.seq_length} + 1; raise --seq-length")
        examples.append(Example(context + target, len(target)))
    return examples, {"strict": cfg.strict_lambada, "examples": len(examples)}


def lambada_results(loss_sum: float, count: int, hits: int, data: dict) -> dict:
    """Cloze accuracy: a hit is every target token predicted greedily."""
    return {"accuracy": hits / data["examples"], "hits": hits, **data}


TASKS = {"WIKITEXT103": (wikitext103, wikitext103_results), "LAMBADA": (lambada, lambada_results)}


def run_task(cfg: TrainConfig, env: launch.Dist) -> dict:
    """Run --task in an initialized world; print and write the results (rank 0), return them."""
    if cfg.task == "GENERATE":
        return write_samples(cfg, sample(cfg, env), env)
    read, summarize = TASKS[cfg.task]
    examples, data = read(cfg, load_tokenizer(cfg.tokenizer_type, cfg.vocab_size))  # data mistakes before the model loads
    model = load_model(cfg, env.device)
    results = {"task": cfg.task, **summarize(*score_all(model, examples, cfg, env.device), data)}
    launch.say(" | ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()))
    if env.is_main and cfg.metrics_file:
        with open(cfg.metrics_file, "w") as f:
            f.write(json.dumps(results) + "\n")
    return results


# ----------------------------------------------------------------------------
# 5. Samples

def sample(cfg: TrainConfig, env: launch.Dist) -> list[dict]:
    """One continuation per prompt (--sample-input-file's lines, or --num-samples
    empty ones), in order. Data-parallel ranks take every D-th prompt; prompt i
    samples with a generator seeded --seed + i, so the samples depend on the
    seed alone, not on the layout."""
    enc, prompts = load_tokenizer(cfg.tokenizer_type, cfg.vocab_size), [""] * cfg.num_samples
    eod = enc.eot_token
    if cfg.sample_input_file:  # a blank line: an unconditional sample
        prompts = read_text(cfg.sample_input_file, "--sample-input-file").rstrip("\n").split("\n")
    model = load_model(cfg, env.device)
    if cfg.out_seq_length > model.config.max_position_embeddings:
        # as Megatron's: at most the positions it was trained at (learned or RoPE),
        # not hours of tokens from a window sliding past them
        raise UsageError(f"--out-seq-length {cfg.out_seq_length}: more than the model's "
                         f"{model.config.max_position_embeddings} positions; give "
                         f"{model.config.max_position_embeddings} or less")
    mine = {}
    for i in range(parallel.layout.dp_rank, len(prompts), parallel.layout.dp_size):
        ids = enc.encode_ordinary(prompts[i]) or [eod]  # empty: from <|endoftext|>
        if len(ids) >= model.config.max_position_embeddings:
            raise UsageError(f"--sample-input-file line {i + 1}: {len(ids)} tokens, the model sees "
                             f"{model.config.max_position_embeddings}; shorten the prompt")
        gen = torch.Generator(device=env.device).manual_seed(cfg.seed + i)
        with autocast(cfg, env.device):
            out = generate(model, torch.tensor([ids], device=env.device), cfg.out_seq_length,
                           cfg.temperature, cfg.top_k or None, cfg.top_p or None,
                           eos_token_id=eod, generator=gen)[0, len(ids):].tolist()
        new = out[:out.index(eod)] if eod in out else out
        mine[i] = {"prompt": prompts[i], "text": enc.decode(new), "tokens": new}
    if parallel.layout.dp_size > 1:  # every rank's samples, back in prompt order
        everyone = [None] * parallel.layout.dp_size
        dist.all_gather_object(everyone, mine, group=parallel.layout.dp_group)
        mine = {i: s for part in everyone for i, s in part.items()}
    return [mine[i] for i in range(len(prompts))]


def write_samples(cfg: TrainConfig, samples: list[dict], env: launch.Dist) -> list[dict]:
    """JSON lines {prompt, text, tokens} to --sample-output-file, or printed (rank 0)."""
    lines = "".join(json.dumps(s) + "\n" for s in samples)
    if cfg.sample_output_file and env.is_main:
        with open(cfg.sample_output_file, "w") as f:
            f.write(lines)
    launch.say(f"wrote {len(samples)} samples to {cfg.sample_output_file}" if cfg.sample_output_file
               else lines.rstrip("\n"))  # (a sample is never empty: json.dumps's braces at least)
    return samples


EVAL_TASKS = (*TASKS, "GENERATE")
GENERATE_FLAGS = ("sample_input_file", "sample_output_file", "num_samples", "out_seq_length", "temperature",
                  "top_k", "top_p")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """eval_tasks.py's flags, checked: one task, one file (or prompts), one model."""
    cfg = config.parse_args(argv, EVALUATE, usage=__doc__)
    if cfg.task is None:
        raise UsageError(f"eval_tasks.py needs --task: {' or '.join(EVAL_TASKS)}")
    if cfg.task not in EVAL_TASKS:
        raise UsageError(f"--task {cfg.task}: use one of {', '.join(EVAL_TASKS)}")
    if cfg.task == "GENERATE":
        if bool(cfg.sample_input_file) == (cfg.num_samples > 0):
            raise UsageError("--task GENERATE needs --sample-input-file FILE (one prompt a line) or "
                             "--num-samples N > 0 (unconditional samples), one of them")
        if cfg.out_seq_length < 1:
            raise UsageError(f"--out-seq-length {cfg.out_seq_length}: generate at least 1 token")
        if cfg.temperature < 0 or cfg.top_k < 0 or not 0 <= cfg.top_p <= 1:
            raise UsageError(f"--temperature {cfg.temperature} (>= 0; 0 is greedy), --top-k {cfg.top_k} "
                             f"(>= 0; 0 is off), --top-p {cfg.top_p} (in [0, 1]; 0 is off)")
    elif not cfg.valid_data:
        raise UsageError(f"--task {cfg.task} needs --valid-data FILE (the task's data)")
    for flag in ("sample_output_file", "metrics_file"):  # written at the end: checked before the model loads
        check_writable(f"--{flag.replace('_', '-')}", getattr(cfg, flag))
    if bool(cfg.load) == bool(cfg.hf):
        raise UsageError("eval_tasks.py needs a model: --load CHECKPOINT (plain or DeepSpeed) "
                         "or --hf DIRECTORY (Hugging Face GPT-2 or Llama), one of them")
    if cfg.overlapping_eval is not None and not 0 < cfg.overlapping_eval <= cfg.seq_length:
        raise UsageError(f"--overlapping-eval {cfg.overlapping_eval} must lie in [1, --seq-length "
                         f"{cfg.seq_length}]")
    if cfg.overlapping_eval is not None and cfg.task != "WIKITEXT103":
        raise UsageError("--overlapping-eval is for --task WIKITEXT103")
    if cfg.strict_lambada and cfg.task != "LAMBADA":
        raise UsageError("--strict-lambada is for --task LAMBADA")
    default = TrainConfig()  # (a sampling flag given at its default value changes nothing either way)
    if cfg.task != "GENERATE" and (given := [f for f in GENERATE_FLAGS if getattr(cfg, f) != getattr(default, f)]):
        raise UsageError(f"{', '.join('--' + f.replace('_', '-') for f in given)}: for --task GENERATE "
                         f"(--task {cfg.task} scores --valid-data; its results go to --metrics-file)")
    return cfg


def check_writable(flag: str, path: str | None) -> None:
    """One line now if `path` cannot be written, not a traceback after the model has run."""
    if path is None:
        return
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        why = "it is a directory"
    elif not os.path.isdir(where):
        why = f"{where} is {'a file' if os.path.exists(where) else 'missing'}, not a directory"
    elif not os.access(where, os.W_OK | os.X_OK):
        why = f"{where} is not writable"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        why = "it is read-only"
    else:
        return
    raise UsageError(f"{flag} {path}: cannot write it: {why}")


def run(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    run_task(cfg, init_processes(cfg))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """eval_tasks.py's command line: a user's mistake is one line from rank 0 (launch.errors_reported)."""
    with launch.errors_reported("eval_tasks.py"):
        run(argv)


if __name__ == "__main__":
    main()
