"""Hugging Face GPT-2 and Llama directories, local ones only, in and out: our
GPT from one (from_hf: evaluate.py --hf, train.py --export-from), and one from
our GPT (to_hf, and its tokenizer: --export-format hf). Both directions
drop/add the vocabulary padding rows (zeros on import: their logits are 0 and
they are never sampled).
"""

import json
import os

import torch

from data import VOCAB_SIZE
from gpt import GPT, GPTConfig, pad_vocab_size
from launch import UsageError, atomic_write, parse_json
from prepare import gpt2_bpe_files
from launch import data_only_loads, named_files

HF_CONFIG = "config.json"  # a Hugging Face model directory's


def from_hf(path: str, **overrides) -> GPT:
    """Our GPT from a local Hugging Face GPT-2 or Llama directory: config.json
    + model.safetensors (or pytorch_model.bin, or a sharded safetensors index).
    `overrides`: GPTConfig fields the caller chooses (kernels, dropout, ...)."""
    hf = _read_hf_config(path)
    kind = hf.get("model_type", "gpt2")
    if kind not in ("gpt2", "llama"):
        raise UsageError(f"HF model_type {kind!r} in {path} is not supported: use a gpt2 or "
                         f"llama checkpoint")
    to_config, to_ours = ((config_from_hf, hf_to_ours) if kind == "gpt2"
                          else (llama_config_from_hf, llama_hf_to_ours))
    config = to_config(hf, **overrides)
    model = GPT(config)
    model.load_full_state_dict(to_ours(_read_hf_weights(path), config))
    return model


def to_hf(model: GPT, path: str) -> None:
    """Write config.json + model.safetensors (pytorch_model.bin if the
    safetensors package is missing), atomically, for transformers'
    AutoModelForCausalLM.from_pretrained(path) (GPT2LMHeadModel or
    LlamaForCausalLM); see hf_architecture."""
    kind = hf_architecture(model.config)  # before the (collective) gather: fail fast
    to_config, to_hf_sd = ((config_to_hf, ours_to_hf) if kind == "gpt2"
                           else (llama_config_to_hf, llama_ours_to_hf))
    sd = to_hf_sd(model.full_state_dict(), model.config)
    os.makedirs(path, exist_ok=True)
    try:
        from safetensors.torch import save
        atomic_write(os.path.join(path, "model.safetensors"),
                     lambda f: f.write(save(sd, metadata={"format": "pt"})))
    except ImportError:
        atomic_write(os.path.join(path, "pytorch_model.bin"), lambda f: torch.save(sd, f))
    text = json.dumps(to_config(model.config), indent=2)
    atomic_write(os.path.join(path, HF_CONFIG), lambda f: f.write(text.encode()))


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "tokenizer.model")  # a Hugging Face tokenizer, in any of its forms


def write_hf_tokenizer(path: str, config: GPTConfig, run: dict | None, hf_source: str | None) -> None:
    """The tokenizer beside an exported model, so that transformers'
    AutoTokenizer.from_pretrained(path), and pipeline("text-generation",
    model=path), read text as the model was trained, with no download
    (without one they build an empty tokenizer, silently): a Hugging Face
    source's own files, else GPT-2's for a run on GPT-2's BPE (`run`: its
    TrainConfig; None for weights that came from Hugging Face: a GPT-2-sized
    vocabulary), as vocab.json and merges.txt (Megatron's gpt2-vocab.json
    and gpt2-merges.txt) and tokenizer_config.json."""
    files = {name: os.path.join(hf_source, name) for name in HF_TOKENIZER_FILES} if hf_source else {}
    files = {name: source for name, source in files.items() if os.path.isfile(source)}
    gpt2 = run["tokenizer_type"] == "GPT2BPETokenizer" if run else config.vocab_size == VOCAB_SIZE
    if not files and gpt2:
        files = dict(zip(("vocab.json", "merges.txt"), gpt2_bpe_files()))
        eod = "<|endoftext|>"  # GPT-2's one special token: also its bos and unk
        text = json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.max_position_embeddings,
                           "bos_token": eod, "eos_token": eod, "unk_token": eod, "add_prefix_space": False})
        atomic_write(os.path.join(path, "tokenizer_config.json"), lambda f: f.write(text.encode()))
    for name, source in files.items():
        with open(source, "rb") as f:
            content = f.read()
        atomic_write(os.path.join(path, name), lambda f: f.write(content))


def hf_architecture(config: GPTConfig) -> str:
    """"gpt2" or "llama": the transformers architecture that computes exactly
    this model (the default options are GPT-2; rope + RMSNorm + SwiGLU, with
    or without GQA, biases or a tied head, is Llama; either with a head of
    its own or not); else a UsageError naming the closer one and its flags."""
    c = config
    # what each architecture needs: (holds for this config?, the flag that makes it hold)
    needs = {"gpt2": [(c.position_embedding_type == "learned_absolute",
                       "--position-embedding-type learned_absolute"),
                      (c.normalization == "LayerNorm", "--normalization LayerNorm"),
                      (not c.swiglu, "no --swiglu"),
                      (not c.disable_bias_linear, "no --disable-bias-linear"),
                      (c.num_query_groups == c.num_attention_heads, "no --group-query-attention")],
             "llama": [(c.position_embedding_type == "rope", "--position-embedding-type rope"),
                       (c.rotary_percent == 1.0, "--rotary-percent 1.0 (Llama rotates whole heads)"),
                       (c.normalization == "RMSNorm", "--normalization RMSNorm"),
                       (c.swiglu, "--swiglu")]}
    missing = {arch: [flag for ok, flag in needs[arch] if not ok] for arch in needs}
    for arch, flags in missing.items():
        if not flags:
            return arch
    arch = min(missing, key=lambda a: len(missing[a]))
    raise UsageError(f"--export-format hf: no transformers architecture computes this model; "
                     f"the closest, {'GPT-2' if arch == 'gpt2' else 'Llama'}, needs "
                     f"{', '.join(missing[arch])}: train with that, or use --export-format plain")


def _eos(config: GPTConfig) -> int:
    return config.vocab_size - 1  # the end of a document: GPT-2's <|endoftext|>, or NullTokenizer's N


# GPT-2's state dict. HF names: transformer.{wte,wpe,ln_f}, transformer.h.{i}.{ln_1,
# attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}. HF's Conv1D stores weights as
# (in, out), the transpose of nn.Linear's (out, in).

_VOCAB_TABLES = ("wte.weight", "output_layer.weight")  # padded rows here, not in HF
_HF_RENAMES = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
               "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
_HF_UNSUPPORTED = {  # HF GPT-2 options this model does not implement -> required value
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "add_cross_attention": False,
}


def config_from_hf(hf: dict, **overrides) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UsageError(f"HF activation_function {act!r} is not supported; this GPT uses "
                         f"tanh-approximate GELU ('gelu_new')")
    for key, want in _HF_UNSUPPORTED.items():
        if hf.get(key, want) != want:
            raise UsageError(f"HF config has {key}={hf[key]!r}; only {want!r} is supported")
    vocab = hf.get("vocab_size", 50257)
    return GPTConfig(**{**dict(
        num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"), max_position_embeddings=hf["n_positions"],
        vocab_size=vocab, padded_vocab_size=pad_vocab_size(vocab),
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), init_method_std=hf.get("initializer_range", 0.02),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True)),
        **overrides})  # the caller's choices win


def config_to_hf(config: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size, "activation_function": "gelu_new",
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout, "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "bos_token_id": _eos(config), "eos_token_id": _eos(config),
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


def _is_conv1d_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{k}." in name for k in _HF_RENAMES)


def hf_to_ours(sd: dict, config: GPTConfig) -> dict:
    """HF GPT-2 state dict -> ours: rename, transpose Conv1D weights, pad wte (and an untied lm_head)."""
    out = {}
    for name, t in sd.items():
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # HF's causal-mask buffers, not weights
        if name == "lm_head.weight":
            if config.untie_embeddings_and_output_weights:
                out["output_layer.weight"] = _pad_vocab_rows(t, config)
            elif not torch.equal(t, sd.get("transformer.wte.weight", sd.get("wte.weight"))):
                raise UsageError("HF lm_head.weight differs from wte.weight, but config.json ties them "
                                 "(tie_word_embeddings)")
            continue
        if _is_conv1d_weight(name):
            t = t.t()
        for old, new in _HF_RENAMES.items():
            name = name.replace(f".{old}.", f".{new}.")
        if name.startswith("h."):
            name = "blocks." + name[2:]
        out[name] = t.contiguous()
    wte = out.get("wte.weight")
    if wte is None or wte.shape[0] != config.vocab_size:
        raise UsageError(f"HF wte.weight missing or not {config.vocab_size} rows")
    out["wte.weight"] = _pad_vocab_rows(wte, config)
    return out


def ours_to_hf(sd: dict, config: GPTConfig) -> dict:
    """Our state dict -> HF GPT-2's (a tied lm_head omitted: HF re-ties it to wte)."""
    out = {}
    for name, t in sd.items():
        if name in _VOCAB_TABLES:
            t = t[:config.vocab_size]  # drop the padding rows
        if name == "output_layer.weight":
            out["lm_head.weight"] = t.detach().cpu().contiguous().clone()
            continue
        if name.startswith("blocks."):
            name = "h." + name[len("blocks."):]
        for old, new in _HF_RENAMES.items():
            name = name.replace(f".{new}.", f".{old}.")
        if _is_conv1d_weight(name):
            t = t.t()
        out["transformer." + name] = t.detach().cpu().contiguous().clone()
    return out


# Llama's state dict. HF names: model.embed_tokens, model.layers.{i}.{input_layernorm,
# self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj},
# model.norm, lm_head. Weights are nn.Linear's (out, in), like ours. Our fused
# qkv is [q_proj | k_proj | v_proj] and our fc is [gate_proj | up_proj], and
# both sides rotate half-dims apart (apply_rope), so nothing is permuted.


def _llama_names(config: GPTConfig) -> list[tuple[str, list[str], list[int] | None]]:
    """(our name, HF names, row sizes): each of our tensors is one HF tensor,
    or (sizes given) the HF tensors stacked along dim 0."""
    H, Fh = config.hidden_size, config.ffn_hidden_size
    kv = config.num_query_groups * config.head_dim
    table = [("wte.weight", ["model.embed_tokens.weight"], None),
             ("ln_f.weight", ["model.norm.weight"], None)]
    if config.untie_embeddings_and_output_weights:
        table.append(("output_layer.weight", ["lm_head.weight"], None))
    kinds = ("weight",) if config.disable_bias_linear else ("weight", "bias")
    for i in range(config.num_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        table += [(ours + "ln_1.weight", [hf + "input_layernorm.weight"], None),
                  (ours + "ln_2.weight", [hf + "post_attention_layernorm.weight"], None)]
        for k in kinds:
            table += [(ours + f"attn.qkv.{k}", [hf + f"self_attn.{p}_proj.{k}" for p in "qkv"], [H, kv, kv]),
                      (ours + f"attn.proj.{k}", [hf + f"self_attn.o_proj.{k}"], None),
                      (ours + f"mlp.fc.{k}", [hf + f"mlp.{p}_proj.{k}" for p in ("gate", "up")], [Fh, Fh]),
                      (ours + f"mlp.proj.{k}", [hf + f"mlp.down_proj.{k}"], None)]
    return table


def llama_config_from_hf(hf: dict, **overrides) -> GPTConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"HF hidden_act {hf['hidden_act']!r} is not supported; Llama's MLP here is SwiGLU (silu)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UsageError(f"HF RoPE scaling {rope_type!r} is not supported; only plain RoPE (rope_type 'default')")
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    if (hf.get("head_dim") or H // nh) != H // nh:
        raise UsageError(f"HF head_dim {hf['head_dim']} is not hidden_size / num_attention_heads "
                         f"({H // nh}); this model has no separate head dim")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise UsageError("HF attention_bias and mlp_bias differ; --disable-bias-linear sets both")
    G, vocab = hf.get("num_key_value_heads") or nh, hf["vocab_size"]
    return GPTConfig(**{**dict(
        num_layers=hf["num_hidden_layers"], hidden_size=H, num_attention_heads=nh,
        num_query_groups=None if G == nh else G, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=vocab,
        padded_vocab_size=pad_vocab_size(vocab),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), init_method_std=hf.get("initializer_range", 0.02),
        attention_dropout=hf.get("attention_dropout", 0.0), position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        normalization="RMSNorm", swiglu=True, disable_bias_linear=not hf.get("attention_bias", False),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False)),
        **overrides})  # the caller's choices win (evaluate.py: no dropout)


def llama_config_to_hf(config: GPTConfig) -> dict:
    bias, theta = not config.disable_bias_linear, config.rotary_base
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        # rope_theta for transformers 4.x, rope_parameters for 5.x
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": bias, "mlp_bias": bias, "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "bos_token_id": _eos(config), "eos_token_id": _eos(config),
    }


def llama_ours_to_hf(sd: dict, config: GPTConfig) -> dict:
    """Our state dict -> HF Llama's: split qkv and fc, drop the vocab padding."""
    out = {}
    for ours, theirs, sizes in _llama_names(config):
        t = sd[ours][:config.vocab_size] if ours in _VOCAB_TABLES else sd[ours]
        parts = t.split(sizes) if sizes else [t]
        out.update({name: part.detach().cpu().contiguous().clone() for name, part in zip(theirs, parts)})
    return out


def llama_hf_to_ours(sd: dict, config: GPTConfig) -> dict:
    """HF Llama state dict -> ours: stack q/k/v and gate/up, pad the vocab."""
    names = _llama_names(config)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, not a weight
    if not config.untie_embeddings_and_output_weights:
        sd.pop("lm_head.weight", None)  # tied: a copy of embed_tokens, if saved at all
    expected = {n for _, theirs, _ in names for n in theirs}
    if expected != set(sd):
        raise UsageError(f"HF Llama weights do not match its config.json: missing "
                         f"{sorted(expected - set(sd))[:5]}, unexpected {sorted(set(sd) - expected)[:5]}")
    out = {}
    for ours, theirs, _ in names:
        t = torch.cat([sd[n] for n in theirs])
        out[ours] = _pad_vocab_rows(t, config) if ours in _VOCAB_TABLES else t.contiguous()
    return out


def _pad_vocab_rows(t: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """(vocab_size, C) -> (padded_vocab_size, C), zeros below."""
    if t.shape[0] != config.vocab_size:
        raise UsageError(f"HF embedding has {t.shape[0]} rows, config.json's vocab_size is "
                         f"{config.vocab_size}")
    return torch.cat([t, t.new_zeros(config.padded_vocab_size - t.shape[0], t.shape[1])])


# Reading a local directory

def is_hf_directory(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG))


def _read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(cfg_path):
        raise UsageError(f"{cfg_path} not found; from_hf needs a local directory "
                         f"written by save_pretrained (no hub downloads)")
    with open(cfg_path, "rb") as f:
        hf = parse_json(f.read(), cfg_path, ": cut short or damaged")
    if not isinstance(hf, dict):
        raise UsageError(f"{cfg_path} is not a JSON object: not a Hugging Face model's config")
    return hf


def _read_hf_weights(path: str) -> dict:
    st, index, binf = (os.path.join(path, n) for n in
                       ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if os.path.isfile(st) or os.path.isfile(index):
        files = [st] if os.path.isfile(st) else _hf_shards(path, index)
        return {k: v for f in files for k, v in _read_safetensors(f).items()}
    if os.path.isfile(binf):
        with data_only_loads(binf):
            return torch.load(binf, map_location="cpu", weights_only=True)
    raise UsageError(f"no model.safetensors or pytorch_model.bin in {path}")


def _read_safetensors(path: str) -> dict:
    """A safetensors file's tensors; one line where it is not one (cut short, damaged)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except SafetensorError as e:
        raise UsageError(f"{path} is not a safetensors file ({e}): cut short or damaged") from None


def _hf_shards(path: str, index: str) -> list[str]:
    """The files a sharded checkpoint's index maps its weights to: safetensors
    files of its own directory, each there."""
    with open(index, "rb") as f:
        read = parse_json(f.read(), index)
    weight_map = read.get("weight_map") if isinstance(read, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"{index} has no \"weight_map\" (each weight's file): not a sharded checkpoint's index")
    names = sorted(set(map(str, weight_map.values())))
    for name in names:
        if not name.endswith(".safetensors"):
            raise UsageError(f"{index} maps weights to {name!r}, not a .safetensors file (the only kind it names)")
    return named_files(path, names, index, links=True)
