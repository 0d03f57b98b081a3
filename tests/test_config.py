"""config.py: train.py's flags -> TrainConfig and the model's GPTConfig.

Megatron's flags with Megatron's meaning (and Megatron's spellings), one line
naming the flag to change for anything wrong, --deepspeed_config's JSON merged
under the command line, the sample-based schedule and the batch-size ramp,
and the --compile flags. No process is launched: each test parses a command
line and reads the config back.
"""
import pytest
import torch

import config as config_lib
from conftest import ALL_OPTIONS, tiny_model
from gpt import GPTConfig, LLAMA_OPTIONS


# -----------------------------------------------------------------------------
# The model's options: defaults, validation, and the flags that set them


def test_defaults_are_gpt2():
    c = GPTConfig()
    assert (c.position_embedding_type, c.normalization, c.rotary_base, c.rotary_percent) == \
        ("learned_absolute", "LayerNorm", 10000.0, 1.0)
    assert not (c.swiglu or c.untie_embeddings_and_output_weights or c.disable_bias_linear)
    assert c.num_query_groups == c.num_attention_heads and c.ffn_hidden_size == 4 * c.hidden_size
    m = tiny_model()
    assert hasattr(m, "wpe") and not hasattr(m, "output_layer")
    assert isinstance(m.ln_f, torch.nn.LayerNorm)
    assert m.blocks[0].attn.qkv.weight.shape == (3 * 64, 64) and m.blocks[0].attn.qkv.bias is not None


@pytest.mark.parametrize("bad,flag", [
    (dict(position_embedding_type="alibi"), "--position-embedding-type"),
    (dict(normalization="rmsnorm"), "--normalization"),
    (dict(num_query_groups=3), "--num-query-groups"),          # 3 does not divide 4 heads
    (dict(num_query_groups=0), "--num-query-groups"),
    (dict(rotary_percent=0.0), "--rotary-percent"),
    (dict(rotary_percent=1.5), "--rotary-percent"),
    # head dim 16: 0.3 * 16 = 4.8 -> 4 (even, fine); 0.2 * 16 = 3.2 -> 3 (odd)
    (dict(position_embedding_type="rope", rotary_percent=0.2), "--rotary-percent"),
    (dict(rotary_base=0.0), "--rotary-base"),
])
def test_bad_options_name_the_flag_to_change(bad, flag):
    with pytest.raises(ValueError, match=flag):
        GPTConfig.from_preset("tiny", **bad)


def test_flags_reach_the_model_config():
    cfg = config_lib.parse_args([
        "--preset", "tiny", "--position-embedding-type", "rope", "--rotary-base", "500",
        "--rotary-percent", "0.5", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64"])
    got = config_lib.model_config(cfg)
    for name, value in ALL_OPTIONS.items():
        assert getattr(got, name) == value, name
    # Without the flags: the preset's choices (GPT-2's for "tiny", Llama's for "llama-tiny").
    plain = config_lib.model_config(config_lib.parse_args(["--preset", "tiny", "--seq-length", "64"]))
    assert plain.position_embedding_type == "learned_absolute" and not plain.swiglu
    llama = config_lib.model_config(config_lib.parse_args(["--preset", "llama-tiny", "--seq-length", "64"]))
    assert {k: getattr(llama, k) for k in LLAMA_OPTIONS} == LLAMA_OPTIONS
    assert llama.num_query_groups == 2


@pytest.mark.parametrize("argv,message", [
    (["--num-query-groups", "2"], "needs --group-query-attention"),
    (["--group-query-attention"], "needs --num-query-groups"),
    (["--rotary-base", "500", "--position-embedding-type", "learned_absolute"],
     "need --position-embedding-type rope"),
])
def test_flags_that_go_in_pairs(argv, message):
    with pytest.raises(ValueError, match=message):
        config_lib.parse_args(["--preset", "tiny", *argv])


# -----------------------------------------------------------------------------
# Megatron's flags: typed, checked, never abbreviated


def test_megatron_flags_fill_typed_config():
    cfg = config_lib.parse_args(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "4",
                            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
                            "--lr-decay-style", "linear", "--data-path", "0.3", "A", "0.7", "B",
                            "--bf16", "--checkpoint-activations", "--local_rank", "3"])
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (3, 96, 4)
    assert cfg.global_batch_size == 8 and cfg.bf16 and cfg.recompute_activations
    assert cfg.data_path == ["0.3", "A", "0.7", "B"]
    mcfg = config_lib.model_config(cfg)
    assert mcfg.max_position_embeddings >= 64 and mcfg.activation_checkpointing
    assert mcfg.loss_impl == "fused"  # the default; the full-logits path is one flag away
    assert config_lib.model_config(config_lib.parse_args(["--preset", "tiny", "--loss-impl", "full"])).loss_impl == "full"


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--bf16", "--fp16"], "mutually exclusive"),
    (["--preset", "tiny", "--lr-decay-style", "exp"], "cosine, linear or constant"),
    ([], "--preset"),
    (["--preset", "tiny", "--seq-length", "4096", "--max-position-embeddings", "64"], "exceeds"),
    (["--preset", "tiny", "--sequence-parallel"], "needs --tensor-model-parallel-size > 1"),
    (["--preset", "tiny", "--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "30"],
     "--seq-length 30 must be divisible by --tensor-model-parallel-size 4"),
    (["--preset", "tiny", "--sequence-parallel", "--tensor-model-parallel-size", "2", "--deepspeed",
      "--recompute-activations", "--partition-activations"], "drop --partition-activations"),
])
def test_bad_flags_are_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        config_lib.model_config(config_lib.parse_args(argv))


@pytest.mark.parametrize("prefix", ["--recompute", "--init"])
def test_a_prefix_of_a_flag_is_not_that_flag(prefix):
    """Megatron turns argparse's abbreviations off; so do we: a typo or a
    shortened flag is an error, not silently --recompute-activations or
    --initial-loss-scale."""
    with pytest.raises(ValueError, match=f"unrecognized arguments: {prefix}"):
        config_lib.parse_args(["--preset", "tiny", prefix, "1"] if prefix == "--init" else
                          ["--preset", "tiny", prefix])

