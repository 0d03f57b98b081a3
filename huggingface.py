"""Hugging Face directories (GPT-2, Llama, Qwen3; the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE), local ones only, in and out: our GPT from one (from_hf:
eval_tasks.py --hf, train.py --export-from), and one from our GPT (to_hf, and its
tokenizer: --export-format hf). Both directions drop/add the vocabulary padding
rows (zeros on import: their logits are 0 and they are never sampled).
"""

import json
import os
import re

import torch

from data import VOCAB_SIZE
from gpt import GPT, GPTConfig, claimed_shapes, is_moe_layer, pad_vocab_size, wanted_type
from launch import UsageError, atomic_write, data_only_loads, named_files, parse_json, plain_file_problem, small_file
from prepare import gpt2_bpe_files

HF_CONFIG = "config.json"  # a Hugging Face model directory's
JSON_MOST = 16 << 20  # bytes: a model's config.json or shard index is KBs; a file this long is no such file
TOKENIZER_MOST = 256 << 20  # bytes: a tokenizer's files are MBs
HF_CLASSES = {"gpt2": ("GPT2LMHeadModel", "GPT-2"), "llama": ("LlamaForCausalLM", "Llama"),  # model_type ->
              "qwen3": ("Qwen3ForCausalLM", "Qwen3"), "mixtral": ("MixtralForCausalLM", "Mixtral"),  # (class, name)
              "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2-MoE"), "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3-MoE")}


def from_hf(path: str, **overrides) -> GPT:
    """Our GPT from a local Hugging Face directory (HF_CLASSES): config.json
    + model.safetensors (or pytorch_model.bin, or a sharded safetensors index).
    `overrides`: GPTConfig fields the caller chooses (kernels, dropout, ...)."""
    hf = _read_hf_config(path)
    kind = hf.get("model_type", "gpt2")
    if kind not in HF_CLASSES:
        raise UsageError(f"HF model_type {kind!r} in {path} is not supported: use one of {', '.join(HF_CLASSES)}")
    where = os.path.join(path, HF_CONFIG)
    shapes, read = _hf_weights(path)
    check_layers(hf, shapes, where)  # first: config_from_hf lists Qwen-MoE's layers, _hf_names every layer's names
    config = config_from_hf(hf, where, **overrides)
    check_claim(config, shapes, where)  # before a model of its size is built
    model = GPT(config)
    model.load_full_state_dict(hf_to_ours(read(), config))
    return model


def to_hf(model: GPT, path: str) -> None:
    """Write config.json + model.safetensors (pytorch_model.bin without the
    safetensors package), atomically, for transformers'
    AutoModelForCausalLM.from_pretrained(path); see hf_architecture."""
    hf_architecture(model.config)  # before the (collective) gather: fail fast
    sd = ours_to_hf(model.full_state_dict(), model.config)
    os.makedirs(path, exist_ok=True)
    try:
        from safetensors.torch import save
        atomic_write(os.path.join(path, "model.safetensors"),
                     lambda f: f.write(save(sd, metadata={"format": "pt"})))
    except ImportError:
        atomic_write(os.path.join(path, "pytorch_model.bin"), lambda f: torch.save(sd, f))
    text = json.dumps(config_to_hf(model.config), indent=2)
    atomic_write(os.path.join(path, HF_CONFIG), lambda f: f.write(text.encode()))


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "tokenizer.model")  # a Hugging Face tokenizer, in any of its forms


def hf_tokenizer(config: GPTConfig, run: dict | None, hf_source: str | None) -> dict[str, bytes]:
    """The tokenizer to write beside an exported model (name -> bytes), so that transformers'
    AutoTokenizer.from_pretrained(path) and pipeline("text-generation",
    model=path) read text as the model was trained, with no download (without
    one they build an empty tokenizer, silently): a Hugging Face source's own
    files, else GPT-2's for a run on GPT-2's BPE (`run`: its TrainConfig; None
    for weights from Hugging Face: a GPT-2-sized vocabulary), as vocab.json,
    merges.txt (Megatron's gpt2-vocab.json, gpt2-merges.txt) and tokenizer_config.json.
    A source's files are held to its weights' rule (_own_path): none is read through a
    link that leads out of it (an exported directory is uploaded: /etc/passwd would go too)."""
    own = [name for name in HF_TOKENIZER_FILES if hf_source and os.path.lexists(os.path.join(hf_source, name))]
    contents = {name: small_file(_own_path(hf_source, name), TOKENIZER_MOST) for name in own}  # all before a write
    gpt2 = run["tokenizer_type"] == "GPT2BPETokenizer" if run else config.vocab_size == VOCAB_SIZE
    if not contents and gpt2:
        contents = {name: small_file(source, TOKENIZER_MOST)
                    for name, source in zip(("vocab.json", "merges.txt"), gpt2_bpe_files())}
        eod = "<|endoftext|>"  # GPT-2's one special token: also its bos and unk
        text = json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.max_position_embeddings,
                           "bos_token": eod, "eos_token": eod, "unk_token": eod, "add_prefix_space": False})
        contents["tokenizer_config.json"] = text.encode()
    return contents


def write_files(path: str, contents: dict[str, bytes]) -> None:
    for name, content in contents.items():
        atomic_write(os.path.join(path, name), lambda f, c=content: f.write(c))


def hf_architecture(config: GPTConfig) -> str:
    """The transformers architecture (HF_CLASSES) that computes exactly this model:
    the default options are GPT-2; rope + RMSNorm + SwiGLU is Llama (with or without
    GQA or biases), Qwen3 with --qk-layernorm; with experts (softmax top-k, dropless,
    no biases) Mixtral, Qwen2-MoE with a gated shared expert, Qwen3-MoE with
    --qk-layernorm; either tied or not. Else a UsageError naming the closest one and its flags."""
    c, moe, qk, shared = config, config.num_experts is not None, config.qk_layernorm, \
        bool(config.moe_shared_expert_intermediate_size)
    # what each architecture needs: (holds for this config?, the flag that makes it hold)
    llama = [(c.position_embedding_type == "rope", "--position-embedding-type rope"),
             (c.rotary_percent == 1.0, "--rotary-percent 1.0 (Llama rotates whole heads)"),
             (c.normalization == "RMSNorm", "--normalization RMSNorm"), (c.swiglu, "--swiglu")]
    dense, no_qk, no_shared = (not moe, "no --num-experts"), (not qk, "no --qk-layernorm"), \
        (not shared, "no --moe-shared-expert-intermediate-size")
    experts = [*llama, (moe, "--num-experts"), (c.disable_bias_linear, "--disable-bias-linear"),
               (c.moe_router_score_function == "softmax", "--moe-router-score-function softmax"),
               (not c.moe_router_enable_expert_bias, "no --moe-router-enable-expert-bias"),
               (c.moe_expert_capacity_factor is None, "no --moe-expert-capacity-factor (dropless)")]
    needs = {"gpt2": [(c.position_embedding_type == "learned_absolute", "--position-embedding-type learned_absolute"),
                      (c.normalization == "LayerNorm", "--normalization LayerNorm"), (not c.swiglu, "no --swiglu"),
                      (not c.disable_bias_linear, "no --disable-bias-linear"),
                      (c.num_query_groups == c.num_attention_heads, "no --group-query-attention"), dense, no_qk],
             "llama": [*llama, dense, no_qk],
             "qwen3": [*llama, dense, (qk, "--qk-layernorm"), (c.disable_bias_linear, "--disable-bias-linear")],
             "qwen2_moe": [*experts, no_qk, (shared, "--moe-shared-expert-intermediate-size"),
                           (c.moe_shared_expert_gate, "--moe-shared-expert-gate")],
             "mixtral": [*experts, no_qk, no_shared, (not c.moe_router_pre_softmax, "no --moe-router-pre-softmax"),
                         (all(is_moe_layer(c, i) for i in range(c.num_layers)), "--moe-layer-freq 1")],
             "qwen3_moe": [*experts, (qk, "--qk-layernorm"), no_shared]}
    missing = {arch: [flag for ok, flag in needs[arch] if not ok] for arch in needs}
    for arch, flags in missing.items():
        if not flags:
            return arch
    arch = min(missing, key=lambda a: (any(f.endswith("--num-experts") for f in missing[a]), len(missing[a])))
    raise UsageError(f"--export-format hf: no transformers architecture computes this model; "
                     f"the closest, {HF_CLASSES[arch][1]}, needs "
                     f"{', '.join(missing[arch])}: train with that, or use --export-format plain")


_HF_UNSUPPORTED = {  # HF GPT-2 options this model does not implement -> required value
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "add_cross_attention": False,
}


# GPTConfig's fields from config.json's keys: field -> (key, its default; _REQUIRED: none)
_REQUIRED = object()
_GPT2_KEYS = {"num_layers": ("n_layer", _REQUIRED), "hidden_size": ("n_embd", _REQUIRED),
              "num_attention_heads": ("n_head", _REQUIRED), "ffn_hidden_size": ("n_inner", None),
              "max_position_embeddings": ("n_positions", _REQUIRED), "layernorm_epsilon": ("layer_norm_epsilon", 1e-5),
              "untie_embeddings_and_output_weights": ("tie_word_embeddings", True)}  # (negated)
_LLAMA_KEYS = {"num_layers": ("num_hidden_layers", _REQUIRED), "hidden_size": ("hidden_size", _REQUIRED),
               "num_attention_heads": ("num_attention_heads", _REQUIRED),
               "num_query_groups": ("num_key_value_heads", None), "ffn_hidden_size": ("intermediate_size", _REQUIRED),
               "max_position_embeddings": ("max_position_embeddings", _REQUIRED),
               "layernorm_epsilon": ("rms_norm_eps", 1e-6), "attention_dropout": ("attention_dropout", 0.0),
               "untie_embeddings_and_output_weights": ("tie_word_embeddings", False),  # (negated)
               "disable_bias_linear": ("attention_bias", False),  # (negated)
               "rotary_base": ("rope_theta", 10000.0)}  # (rope_parameters' own first)
# The experts, on Llama's keys: Mixtral's (every layer MoE, top-k renormalized) and Qwen's
_MIXTRAL_KEYS = {"num_experts": ("num_local_experts", _REQUIRED), "moe_router_topk": ("num_experts_per_tok", _REQUIRED),
                 "moe_ffn_hidden_size": ("intermediate_size", _REQUIRED),
                 "moe_aux_loss_coeff": ("router_aux_loss_coef", 0.001), "rotary_base": ("rope_theta", 1e6)}
_QWEN_MOE_KEYS = {**_MIXTRAL_KEYS, "num_experts": ("num_experts", _REQUIRED), "rotary_base": ("rope_theta", 10000.0),
                  "moe_ffn_hidden_size": ("moe_intermediate_size", _REQUIRED),
                  "moe_router_pre_softmax": ("norm_topk_prob", False)}  # (negated)
_QWEN2_MOE_KEYS = {**_QWEN_MOE_KEYS, "disable_bias_linear": ("qkv_bias", True),  # (negated)
                   "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size", _REQUIRED)}
_HF_KEYS = {"gpt2": _GPT2_KEYS, "llama": _LLAMA_KEYS, "qwen3": _LLAMA_KEYS, "mixtral": _LLAMA_KEYS | _MIXTRAL_KEYS,
            "qwen2_moe": _LLAMA_KEYS | _QWEN2_MOE_KEYS, "qwen3_moe": _LLAMA_KEYS | _QWEN_MOE_KEYS}
_NEGATED = ("untie_embeddings_and_output_weights", "disable_bias_linear", "moe_router_pre_softmax")


def _hf_values(hf: dict, keys: dict, where: str) -> dict:
    """GPTConfig's fields from `hf` by `keys`, each there where
    required and of its field's type (gpt.wanted_type); else one line naming the key."""
    values = {}
    for field, (key, default) in keys.items():
        if key not in hf and default is _REQUIRED:
            raise UsageError(f"{where} has no {key!r}: not a complete {hf.get('model_type', 'gpt2')} config")
        values[field] = hf.get(key, default)
        if wanted := wanted_type(field, values[field]):
            raise UsageError(f"{where}: {key} is {values[field]!r}, not {wanted}")
    return values


def config_from_hf(hf: dict, where: str = HF_CONFIG, **overrides) -> GPTConfig:
    """Our GPTConfig from a config.json of HF_CLASSES (at `where`); `overrides`,
    the caller's choices, win (eval_tasks.py: no dropout)."""
    kind = hf.get("model_type", "gpt2")
    v = _hf_values(hf, {"vocab_size": ("vocab_size", 50257), "init_method_std": ("initializer_range", 0.02)}, where)
    v["padded_vocab_size"] = pad_vocab_size(v["vocab_size"])
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UsageError(f"HF activation_function {act!r} is not supported; this GPT uses "
                             f"tanh-approximate GELU ('gelu_new')")
        for key, want in _HF_UNSUPPORTED.items():
            if hf.get(key, want) != want:
                raise UsageError(f"HF config has {key}={hf[key]!r}; only {want!r} is supported")
        v |= _hf_values(hf, _HF_KEYS[kind], where)
    else:
        v |= _llama_values(hf, kind, where)
    v.update({field: not v[field] for field in _NEGATED if field in v})
    try:
        config = GPTConfig(**{**v, **overrides})
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    if kind != "gpt2" and (hf.get("head_dim", 128 if kind == "qwen3" else None) or config.head_dim) != config.head_dim:
        raise UsageError(f"HF head_dim {hf.get('head_dim', 128)!r} is not hidden_size / num_attention_heads "
                         f"({config.head_dim}); this model has no separate head dim")
    return config


def _llama_values(hf: dict, kind: str, where: str) -> dict:
    """config_from_hf's fields from a config.json of Llama's kind: rope, RMSNorm, SwiGLU, and
    (Qwen3) q and k normed, (Mixtral, Qwen-MoE) experts; what this model has not is one line."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"HF hidden_act {hf['hidden_act']!r} is not supported; Llama's MLP here is SwiGLU (silu)")
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise UsageError(f"{where}: {key} is {rope!r}, not an object (\"rope_type\": ...)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UsageError(f"HF RoPE scaling {rope_type!r} is not supported; only plain RoPE (rope_type 'default')")
    bias = "qkv_bias" if kind == "qwen2_moe" else "attention_bias"  # (Qwen's and Mixtral's MLPs have none)
    if hf.get(bias, kind == "qwen2_moe") != hf.get("mlp_bias", False):
        raise UsageError(f"{where}: {bias} and mlp_bias differ; --disable-bias-linear sets both")
    if hf.get("use_sliding_window") or kind == "mixtral" and hf.get("sliding_window"):
        raise UsageError(f"{where}: sliding_window attention is not supported; this model attends to every token")
    if "num_local_experts" in hf:  # transformers 5's name of Qwen3-MoE's num_experts
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    v = _hf_values({**hf, **rope}, _HF_KEYS[kind], where)
    v.update(rotary_base=float(v["rotary_base"]), position_embedding_type="rope", normalization="RMSNorm",
             swiglu=True, qk_layernorm=kind.startswith("qwen3"), moe_shared_expert_gate=kind == "qwen2_moe")
    if v["num_query_groups"] in (0, v["num_attention_heads"]):  # 0: transformers' "one per head", too
        v["num_query_groups"] = None
    if kind.endswith("_moe"):  # layer i has experts unless in mlp_only_layers, if (i + 1) % step == 0
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if wanted_type("num_layers", step) or step < 1 or not isinstance(dense, list):
            raise UsageError(f"{where}: decoder_sparse_step {step!r} and mlp_only_layers {dense!r} are not a "
                             f"positive int and a list of layers")
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(v["num_layers"])]
        v["moe_layer_freq"] = 1 if all(pattern) else pattern
    return v


def config_to_hf(config: GPTConfig) -> dict:
    """config.json for transformers' class of hf_architecture (HF_CLASSES)."""
    c, eos, arch = config, config.vocab_size - 1, hf_architecture(config)  # eos: GPT-2's <|endoftext|>, or N
    shared = {"architectures": [HF_CLASSES[arch][0]], "model_type": arch, "vocab_size": c.vocab_size,
              "initializer_range": c.init_method_std, "bos_token_id": eos, "eos_token_id": eos,
              "tie_word_embeddings": not c.untie_embeddings_and_output_weights}
    if arch == "gpt2":
        return {**shared, "n_positions": c.max_position_embeddings, "n_embd": c.hidden_size, "n_layer": c.num_layers,
                "n_head": c.num_attention_heads, "n_inner": c.ffn_hidden_size, "activation_function": "gelu_new",
                "resid_pdrop": c.hidden_dropout, "embd_pdrop": c.hidden_dropout,
                "attn_pdrop": c.attention_dropout, "layer_norm_epsilon": c.layernorm_epsilon}
    bias, theta = not c.disable_bias_linear, c.rotary_base
    out = {**shared, "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_query_groups, "head_dim": c.head_dim, "hidden_act": "silu",
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.layernorm_epsilon,
           "attention_bias": bias, "mlp_bias": bias, "attention_dropout": c.attention_dropout,
           # rope_theta for transformers 4.x, rope_parameters for 5.x
           "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    if arch == "mixtral":
        out.update(num_local_experts=c.num_experts, intermediate_size=c.moe_ffn_hidden_size)
    elif arch.endswith("_moe"):  # Qwen's: MoE layers listed (decoder_sparse_step counts from 1, ours from 0)
        out.update(num_experts=c.num_experts, moe_intermediate_size=c.moe_ffn_hidden_size, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(c.num_layers) if not is_moe_layer(c, i)],
                   norm_topk_prob=not c.moe_router_pre_softmax, qkv_bias=False,
                   shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size or 0)
    if c.num_experts is not None:  # (transformers adds the aux loss only with output_router_logits)
        out.update(num_experts_per_tok=c.moe_router_topk, router_aux_loss_coef=c.moe_aux_loss_coeff)
    return out


# The state dicts. GPT-2's HF names: transformer.{wte,wpe,ln_f}, transformer.h.{i}.{ln_1,
# attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}; its Conv1D stores weights as
# (in, out), the transpose of nn.Linear's (out, in). Llama's: model.embed_tokens,
# model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
# mlp.{gate,up,down}_proj}, model.norm, lm_head, (out, in) like ours. Our fused
# qkv is [q_proj | k_proj | v_proj] and our fc is [gate_proj | up_proj], and
# both sides rotate half-dims apart (apply_rope), so nothing is permuted. Qwen3's add
# self_attn.{q,k}_norm; a MoE layer's (Mixtral's block_sparse_moe, Qwen's mlp) are gate
# (the router), experts.{e}.{w1,w3,w2} or .{gate,up,down}_proj as save_pretrained writes
# them (or transformers 5's experts.gate_up_proj, .down_proj, stacked as ours), shared_expert(_gate).

_VOCAB_TABLES = ("wte.weight", "output_layer.weight")  # padded rows here, not in HF
_STACKED = ("experts.fc", "experts.proj")  # (E, rows, cols) here; E x rows HF rows of cols, or one tensor (fused)
_FUSED = ".experts.gate_up_proj"  # the name of a checkpoint of transformers 5's fused experts
_GPT2_BLOCK = {"ln_1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "ln_2": "ln_2", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}  # ours -> HF's, in a block
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # HF's masks and RoPE: not weights


def _hf_names(config: GPTConfig, fused: bool = False) -> list[tuple[str, list[str], list[int] | None]]:
    """(our name, HF names, row sizes) of every weight: each of ours is one HF
    tensor, or (sizes given) the HF tensors stacked along dim 0 (experts: along
    E x rows). fused: the experts as transformers 5 holds them (_FUSED)."""
    c, arch = config, hf_architecture(config)
    if arch == "gpt2":
        outside_blocks = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
        table = [(name, ["transformer." + name], None) for name in outside_blocks]
        for i in range(c.num_layers):
            table += [(f"blocks.{i}.{ours}.{k}", [f"transformer.h.{i}.{theirs}.{k}"], None)
                      for ours, theirs in _GPT2_BLOCK.items() for k in ("weight", "bias")]
    else:
        H, kv = c.hidden_size, c.num_query_groups * c.head_dim
        ks = ("weight",) if c.disable_bias_linear else ("weight", "bias")
        table = [("wte.weight", ["model.embed_tokens.weight"], None), ("ln_f.weight", ["model.norm.weight"], None)]
        for i in range(c.num_layers):
            ours, hf = f"blocks.{i}.", f"model.layers.{i}."
            table += [(ours + "ln_1.weight", [hf + "input_layernorm.weight"], None),
                      (ours + "ln_2.weight", [hf + "post_attention_layernorm.weight"], None)]
            for k in ks:
                table += [(ours + f"attn.qkv.{k}", [hf + f"self_attn.{p}_proj.{k}" for p in "qkv"], [H, kv, kv]),
                          (ours + f"attn.proj.{k}", [hf + f"self_attn.o_proj.{k}"], None)]
            table += [(ours + f"attn.{p}_norm.weight", [hf + f"self_attn.{p}_norm.weight"], None)
                      for p in ("qk" if c.qk_layernorm else "")]
            table += _expert_names(c, i, arch, fused) if is_moe_layer(c, i) else \
                _mlp_names(ours + "mlp.", hf + "mlp.", c.ffn_hidden_size, ks)
    if c.untie_embeddings_and_output_weights:
        table.append(("output_layer.weight", ["lm_head.weight"], None))
    return table


def _mlp_names(ours: str, hf: str, width: int, ks=("weight",)) -> list:
    """A SwiGLU MLP's (Llama's, a shared expert's): fc = [gate_proj | up_proj], proj = down_proj."""
    return [entry for k in ks for entry in ((ours + f"fc.{k}", [hf + f"{p}_proj.{k}" for p in ("gate", "up")],
                                             [width, width]), (ours + f"proj.{k}", [hf + f"down_proj.{k}"], None))]


def _expert_names(c: GPTConfig, i: int, arch: str, fused: bool) -> list:
    """Layer i's MoE: router, experts (one HF matrix per expert, or fused), Qwen2-MoE's shared expert."""
    E, ours = c.num_experts, f"blocks.{i}.mlp."
    hf = f"model.layers.{i}." + ("block_sparse_moe." if arch == "mixtral" and not fused else "mlp.")
    w = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    table = [(ours + "router.weight", [hf + "gate.weight"], None)]
    if fused:
        table += [(ours + "experts.fc", [hf + "experts.gate_up_proj"], None),
                  (ours + "experts.proj", [hf + "experts.down_proj"], None)]
    else:
        table += [(ours + "experts.fc", [hf + f"experts.{e}.{p}.weight" for e in range(E) for p in w[:2]],
                   [c.moe_ffn_hidden_size] * 2 * E),
                  (ours + "experts.proj", [hf + f"experts.{e}.{w[2]}.weight" for e in range(E)], [c.hidden_size] * E)]
    if c.moe_shared_expert_intermediate_size:
        table += [*_mlp_names(ours + "shared_expert.", hf + "shared_expert.", c.moe_shared_expert_intermediate_size),
                  (ours + "shared_expert_gate.weight", [hf + "shared_expert_gate.weight"], None)]
    return table


def _conv1d(hf_name: str) -> bool:
    """Whether an HF weight is GPT-2's Conv1D, (in, out): ours transposed."""
    return hf_name.endswith(".weight") and any(f".{k}." in hf_name for k in ("c_attn", "c_proj", "c_fc"))


def ours_to_hf(sd: dict, config: GPTConfig) -> dict:
    """Our state dict -> HF's: drop the vocab padding, split qkv, fc and the experts (Llama's kind),
    transpose Conv1D weights (GPT-2); a tied lm_head is omitted (HF re-ties it)."""
    out = {}
    for ours, theirs, sizes in _hf_names(config):
        t = sd[ours][:config.vocab_size] if ours in _VOCAB_TABLES else sd[ours]
        t = t.flatten(0, 1) if sizes and ours.endswith(_STACKED) else t  # (E * rows, cols)
        for name, part in zip(theirs, t.split(sizes) if sizes else [t]):
            out[name] = (part.t() if _conv1d(name) else part).detach().cpu().contiguous().clone()
    return out


def hf_to_ours(sd: dict, config: GPTConfig) -> dict:
    """HF state dict -> ours: stack q/k/v, gate/up and the experts (Llama's kind), transpose Conv1D
    weights (GPT-2), pad the vocab. Its names and shapes are config's (check_claim)."""
    sd, head = _as_named(sd, config)
    # A tied head, if saved at all, is a copy of the embedding (GPT-2's is checked).
    if hf_architecture(config) == "gpt2" and head is not None and not torch.equal(head, sd["transformer.wte.weight"]):
        raise UsageError("HF lm_head.weight differs from wte.weight, but config.json ties them "
                         "(tie_word_embeddings)")
    out = {}
    for ours, theirs, sizes in _hf_names(config, any(k.endswith(_FUSED) for k in sd)):
        t = torch.cat([sd[n].t() if _conv1d(n) else sd[n] for n in theirs])
        if sizes and ours.endswith(_STACKED):  # (E * rows, cols) -> (E, rows, cols)
            t = t.unflatten(0, (config.num_experts, -1))
        if ours in _VOCAB_TABLES:  # (vocab_size, C) -> (padded_vocab_size, C), zeros below
            t = torch.cat([t, t.new_zeros(config.padded_vocab_size - t.shape[0], t.shape[1])])
        out[ours] = t.contiguous()
    return out


def _as_named(sd: dict, config: GPTConfig) -> tuple[dict, object]:
    """An HF state dict (of tensors, or of shapes) named as _hf_names names it, HF's
    buffers dropped; and a tied head's entry (None if none: HF re-ties it)."""
    sd = {k: v for k, v in sd.items() if not k.endswith(_HF_BUFFERS)}
    if hf_architecture(config) == "gpt2":  # GPT-2's original checkpoints name its weights without "transformer."
        sd = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in sd.items()}
    return sd, None if config.untie_embeddings_and_output_weights else sd.pop("lm_head.weight", None)


def check_layers(hf: dict, shapes: dict, where: str) -> None:
    """config.json's layer count (at `where`) against its weights' (HF name -> shape,
    from the files' headers), first: even the table of 20000 layers' names is long."""
    claimed = _hf_values(hf, {"num_layers": _HF_KEYS[hf.get("model_type", "gpt2")]["num_layers"]}, where)
    layers = {m[1] for k in shapes if (m := re.match(r"(?:transformer\.)?(?:h|model\.layers)\.(\d+)\.", k))}
    if len(layers) != claimed["num_layers"]:
        raise UsageError(f"{where} says {claimed['num_layers']} layers, its weights hold {len(layers)}: they are "
                         f"not one model's")


def check_claim(config: GPTConfig, shapes: dict, where: str) -> None:
    """config.json (at `where`) against its weights' shapes (as check_layers), before a
    model of its size is built: a config.json claiming 20000 layers, 10**9 experts, or
    a width of 2**20, over weights of a few MB, is one line."""
    shapes, _ = _as_named({k: tuple(s) for k, s in shapes.items()}, config)
    fused = any(k.endswith(_FUSED) for k in shapes)
    experts = {m[1] for k in shapes if (m := re.search(r"\.experts\.(\d+)\.", k))}  # first, as layers: names
    if config.num_experts is not None and not fused and len(experts) != config.num_experts:
        raise UsageError(f"{where} says {config.num_experts} experts, its weights hold {len(experts)}: they are "
                         f"not one model's")
    names = _hf_names(config, fused)
    expected = {n for _, theirs, _ in names for n in theirs}
    if expected != set(shapes):
        raise UsageError(f"the weights beside {where} do not match it: missing {sorted(expected - set(shapes))[:5]}, "
                         f"unexpected {sorted(set(shapes) - expected)[:5]}")
    ours = claimed_shapes(config, where)  # on the meta device
    for name, theirs, sizes in names:
        shape = ours[name]
        shape = (shape[0] * shape[1], *shape[2:]) if sizes and name.endswith(_STACKED) else shape
        rest = shape[1:]
        rows = [config.vocab_size] if name in _VOCAB_TABLES else sizes or [shape[0]]
        for hf_name, want in zip(theirs, ((n, *rest) for n in rows)):
            want = want[::-1] if _conv1d(hf_name) else want
            if shapes[hf_name] != want:
                raise UsageError(f"{where} does not describe its weights: {hf_name} is of shape "
                                 f"{shapes[hf_name]} there, of shape {want} by {HF_CONFIG}")


# Reading a local directory: config.json, the weights and the tokenizer's files are each
# a regular file of it, or a link that stays in place (launch.link_in_place: a Hugging
# Face cache's snapshot links into its blobs/), of a bounded size

def is_hf_directory(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG))


def _own_path(directory: str, name: str) -> str:
    """directory/name, a file of the Hugging Face `directory`; else one line."""
    if problem := plain_file_problem(directory, name, links=True):
        raise UsageError(f"refusing to read {os.path.join(directory, name)}: {problem}. Load models only from a "
                         f"source you trust")
    return os.path.join(directory, name)


def _read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, HF_CONFIG)
    if not os.path.lexists(cfg_path):
        raise UsageError(f"{cfg_path} not found; from_hf needs a local directory "
                         f"written by save_pretrained (no hub downloads)")
    hf = parse_json(small_file(_own_path(path, HF_CONFIG), JSON_MOST), cfg_path, ": cut short or damaged")
    if not isinstance(hf, dict):
        raise UsageError(f"{cfg_path} is not a JSON object: not a Hugging Face model's config")
    return hf


def _hf_weights(path: str):
    """(HF name -> shape of each weight, from the files' own headers; a function that
    reads the weights): model.safetensors, a sharded one's index, or pytorch_model.bin
    (read whole: torch.load's index is its pickle)."""
    there = [n for n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
             if os.path.lexists(os.path.join(path, n))]
    if not there:
        raise UsageError(f"no model.safetensors or pytorch_model.bin in {path}")
    if there[0] == "pytorch_model.bin":
        binf = _own_path(path, there[0])
        with data_only_loads(binf):
            weights = torch.load(binf, map_location="cpu", weights_only=True)
        if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                    for k, t in weights.items()):
            raise UsageError(f"{binf} holds no state dict (a dict of tensors)")
        return {k: t.shape for k, t in weights.items()}, lambda: weights
    files = [_own_path(path, there[0])] if there[0] == "model.safetensors" else _hf_shards(path, there[0])
    shapes = {k: s for f in files for k, s in _read_safetensors(f, shapes=True).items()}
    return shapes, lambda: {k: t for f in files for k, t in _read_safetensors(f).items()}


def _read_safetensors(path: str, shapes: bool = False) -> dict:
    """A safetensors file's tensors, or (`shapes`) their shapes, read from its header
    alone (which the library checks against the file's size); one line where it is
    not one (cut short, damaged)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file
    try:
        if not shapes:
            return load_file(path)
        with safe_open(path, "pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}
    except SafetensorError as e:
        raise UsageError(f"{path} is not a safetensors file ({e}): cut short or damaged") from None


def _hf_shards(path: str, name: str) -> list[str]:
    """The files a sharded checkpoint's index maps its weights to: safetensors
    files of its own directory, each there."""
    index = os.path.join(path, name)
    read = parse_json(small_file(_own_path(path, name), JSON_MOST), index)
    weight_map = read.get("weight_map") if isinstance(read, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"{index} has no \"weight_map\" (each weight's file): not a sharded checkpoint's index")
    names = sorted(set(map(str, weight_map.values())))
    for name in names:
        if not name.endswith(".safetensors"):
            raise UsageError(f"{index} maps weights to {name!r}, not a .safetensors file (the only kind it names)")
    return named_files(path, names, index, links=True)
