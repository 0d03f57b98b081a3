"""Pretraining data: Megatron's mmap token format, GPT samples, blending, sampling.

1. The indexed dataset PREFIX.bin + PREFIX.idx, byte-compatible with Megatron-LM:
   .bin holds the documents' tokens end to end (a document is one sequence), .idx
   where each starts. Both are memory-mapped: opening a 100 GB corpus costs nothing.

       .idx layout (little endian)
         9 bytes   magic  b"MMIDIDX\\x00\\x00"
         u64       version (1)
         u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                   6 float64, 7 float32, 8 uint16)
         u64       S = number of sequences
         u64       D = number of document boundaries (documents + 1)
         int32[S]  sequence lengths, in tokens
         int64[S]  sequence start offsets into .bin, in BYTES
         int64[D]  document boundaries as sequence indices, starting with 0

2. The GPT dataset: a split's documents, shuffled and repeated for as many
   epochs as needed, read as one token stream cut into samples of
   seq_length + 1 tokens (sample i+1 starts on the last token of sample i).
   Megatron's index arrays doc_idx, sample_idx and shuffle_idx describe it;
   numpy builds them in seconds even for 1e9 tokens, cached as .npy files.
3. Blending corpora by weight, and the sampler that hands each data-parallel
   rank its share of every global batch and resumes from consumed samples.
4. The vocabulary the tokens index: how GPT-2's BPE files are recognized
   (check_gpt2_bpe, for --vocab-file / --merge-file; prepare.py tokenizes).
"""
import hashlib
import json
import math
import os
import re
import shutil
import struct

import numpy as np
import torch

from launch import UsageError, atomic_write, fsync_path, parse_json, say, text_file

# ----------------------------------------------------------------------------
# 1. Megatron mmap indexed dataset (.bin/.idx)

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER_BYTES = len(_INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype, S, D
_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
                5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF_DTYPE = {np.dtype(t): code for code, t in _DTYPE_CODES.items()}


def best_dtype(vocab_size: int):
    """Smallest token dtype for a vocabulary: uint16 halves the .bin size (GPT-2's
    50257 tokens fit); the 65500 threshold is Megatron's."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        names = ", ".join(np.dtype(t).name for t in _DTYPE_CODES.values())
        raise UsageError(f"token dtype {dtype.name} cannot be stored in a Megatron .idx file; use one of: {names}")
    return _CODE_OF_DTYPE[dtype]


def _corrupt(path: str, problem: str) -> UsageError:
    return UsageError(f"{path}: {problem}; the file is truncated or corrupt, re-run prepare.py to rebuild it")


class IndexedDataset(torch.utils.data.Dataset):
    """Read-only view of PREFIX.bin / PREFIX.idx; ds[i] is sequence i as a numpy array.
    Opening validates the whole index against the .bin size, so a truncated copy
    fails here rather than yielding garbage tokens mid-run."""

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise UsageError(
                    f"{path} not found: expected a Megatron .bin/.idx pair at prefix {path_prefix!r}. "
                    "Create it with prepare.py (e.g. --output-prefix P --json-key text writes P_text_document.bin/.idx) "
                    "and pass the prefix without the extension")
        self._read_index(idx_path)
        expected, actual = self.num_tokens * self.dtype.itemsize, os.path.getsize(bin_path)
        if actual != expected:
            raise _corrupt(bin_path, f"the index describes {self.num_tokens} tokens = {expected} bytes, "
                                     f"but the .bin file has {actual} bytes")
        # np.memmap refuses empty files; an empty corpus is still a valid dataset.
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if actual else np.empty(0, self.dtype)

    def _read_index(self, idx_path: str):
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or header[:9] != _INDEX_MAGIC:
            raise _corrupt(idx_path, f"not a Megatron mmap index (expected magic {_INDEX_MAGIC!r}, got {header[:9]!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != _INDEX_VERSION:
            raise UsageError(f"{idx_path}: index version {version} is not supported (only version {_INDEX_VERSION})")
        if code not in _DTYPE_CODES:
            raise _corrupt(idx_path, f"unknown dtype code {code} (valid: {sorted(_DTYPE_CODES)})")
        expected = _HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_bytes != expected:
            raise _corrupt(idx_path, f"header promises {n_seq} sequences and {n_doc} document boundaries "
                                     f"= {expected} bytes, but the file has {idx_bytes} bytes")
        self.dtype = np.dtype(_DTYPE_CODES[code])
        self._idx_map = np.memmap(idx_path, dtype=np.uint8, mode="r")  # non-empty: it holds the header
        buf = self._idx_map
        self.sizes = np.frombuffer(buf, np.int32, n_seq, _HEADER_BYTES)                  # (S,)
        self.pointers = np.frombuffer(buf, np.int64, n_seq, _HEADER_BYTES + 4 * n_seq)   # (S,)
        self.doc_idx = np.frombuffer(buf, np.int64, n_doc, _HEADER_BYTES + 12 * n_seq)   # (D,)
        sizes = self.sizes.astype(np.int64)
        if (sizes < 0).any():
            raise _corrupt(idx_path, "negative sequence length")
        if not np.array_equal((np.cumsum(sizes) - sizes) * self.dtype.itemsize, self.pointers):
            raise _corrupt(idx_path, "sequence pointers disagree with the sequence lengths")
        d = self.doc_idx
        if len(d) == 0 or d[0] != 0 or d[-1] != len(sizes) or (np.diff(d) < 0).any():
            raise _corrupt(idx_path, f"document boundaries must rise from 0 to {len(sizes)}")
        self.num_tokens = int(sizes.sum())

    # Memmaps do not pickle cheaply: ship the prefix and reopen (DataLoader workers).
    def __getstate__(self):
        return self.path_prefix

    def __setstate__(self, path_prefix):
        self.__init__(path_prefix)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (to its end if length is None)."""
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} with {n} sequences")
        i %= n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {size}")
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return np.asarray(self._bin[start:start + length])  # a plain ndarray view of the mapped file


def write_index_file(idx_path: str, sizes, doc_idx, dtype) -> None:
    """Write a .idx file for sequences of `sizes` tokens."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and sizes.max() > np.iinfo(np.int32).max:
        raise UsageError("a sequence longer than 2**31-1 tokens cannot be indexed; split the document")
    with open(idx_path, "wb") as f:
        f.write(_INDEX_MAGIC)
        f.write(struct.pack("<QBQQ", _INDEX_VERSION, _dtype_code(dtype), len(sizes), len(doc_idx)))
        f.write(sizes.astype(np.int32).tobytes())
        f.write(((np.cumsum(sizes) - sizes) * np.dtype(dtype).itemsize).tobytes())  # byte offsets
        f.write(np.asarray(doc_idx, dtype=np.int64).tobytes())


class IndexedDatasetBuilder:
    """Writes PREFIX.bin / PREFIX.idx byte-identical to megatron-core's builder, via
    PATH.tmp files that finalize() renames into place, so a crash or abort() never
    leaves a half-written pair. As a context manager it cleans up on error."""

    def __init__(self, bin_path: str, dtype=np.uint16):
        _dtype_code(dtype)  # fail now, not at finalize(), on an unsupported dtype
        self.dtype = np.dtype(dtype)
        self.bin_path = bin_path
        self._bin_tmp = bin_path + ".tmp"
        self._idx_tmp = None
        self._bin_file = open(self._bin_tmp, "wb")
        self._sizes = []
        self._doc_idx = [0]
        self._done = False

    def add_document(self, tokens) -> None:
        """Append one document (one sequence) of token ids."""
        arr = np.asarray(tokens).reshape(-1)
        if arr.size and np.issubdtype(self.dtype, np.integer):
            if not np.issubdtype(arr.dtype, np.integer):
                raise UsageError(f"token ids must be integers, got dtype {arr.dtype}")
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise UsageError(f"token id range [{lo}, {hi}] does not fit dtype {self.dtype.name} "
                                 f"([{info.min}, {info.max}]); build with a wider dtype, e.g. best_dtype(vocab_size)")
        self._bin_file.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(arr.size)
        self._doc_idx.append(len(self._sizes))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of an existing PREFIX.bin/.idx (merging shards)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise UsageError(f"cannot merge {path_prefix} (dtype {other.dtype.name}) into a "
                             f"{self.dtype.name} dataset; rebuild both with the same dtype")
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + offset).tolist())
        with open(path_prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._bin_file, 16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Write the index and atomically publish both files."""
        self._bin_file.close()
        self._idx_tmp = idx_path + ".tmp"
        write_index_file(self._idx_tmp, self._sizes, self._doc_idx, self.dtype)
        for tmp in (self._bin_tmp, self._idx_tmp):  # on disk before either name appears
            fsync_path(tmp)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, idx_path)  # last: a visible .idx implies its .bin is complete
        fsync_path(os.path.dirname(os.path.abspath(idx_path)))
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far (no output files are left)."""
        self._bin_file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if path and os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self._done:
            self.abort()
            if exc_type is None:
                raise RuntimeError(f"IndexedDatasetBuilder for {self.bin_path} left without finalize(); "
                                   "nothing was written")


# ----------------------------------------------------------------------------
# 2. GPT dataset: fixed-length samples over a shuffled, repeated document stream

_INDEX_CACHE_VERSION = 2  # bump when the index arrays' meaning changes


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1', or fewer fields) -> normalized [train, valid, test] fractions."""
    fields = [f for f in re.split(r"[,/]", split.strip()) if f.strip()]
    try:
        weights = [float(f) for f in fields]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise UsageError(f"bad split {split!r}: expected 1-3 non-negative numbers with a positive sum, "
                         "separated by ',' or '/', e.g. '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_boundaries(fractions: list[float], num_docs: int) -> list[int]:
    """Document boundaries [0, b1, b2, num_docs]: Megatron rounds each cumulative fraction."""
    cum = np.cumsum([0.0] + list(fractions))
    bounds = [int(round(c * num_docs)) for c in cum]
    bounds[-1] = num_docs  # guard against float drift
    return bounds


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2) array of (position in doc_idx, token offset) where each sample starts.
    Sample i is stream tokens [i*seq_length, (i+1)*seq_length] inclusive: the last target
    of one sample is the first input of the next, so row i+1 is sample i's (inclusive) end."""
    doc_ends = np.cumsum(sizes[doc_idx].astype(np.int64))         # stream position after each doc
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # First document ending after the start token; side="right" skips empty documents.
    doc_pos = np.searchsorted(doc_ends, starts, side="right")
    doc_starts = doc_ends[doc_pos] - sizes[doc_idx[doc_pos]]
    return np.stack([doc_pos, starts - doc_starts], axis=1)


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for num_samples samples; all vectorized numpy."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))  # ceil; +1: the last target
    rng = np.random.RandomState(seed)
    # Each epoch shuffled on its own (Megatron shuffles all at once): each reads every document once.
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(np.int64)
    # Every sample the epochs hold, so the last epoch's are shuffled over the whole epoch too.
    num_built = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_built)
    return doc_idx, sample_idx, shuffle_within_epochs(num_built, tokens_per_epoch, seq_length, rng)


def shuffle_within_epochs(num_samples: int, tokens_per_epoch: int, seq_length: int,
                          rng: np.random.RandomState) -> np.ndarray:
    """Sample order: each epoch's samples (by the token they start at) shuffled among
    themselves, epochs in order, so every document is read once before any is read
    again. One shuffle over all epochs would let a run of 1.1 epochs read ~20% of the
    documents never and ~29% twice."""
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    bounds = np.searchsorted(starts, np.arange(0, starts[-1] + tokens_per_epoch, tokens_per_epoch))
    bounds = np.append(bounds, num_samples)
    return np.concatenate([lo + rng.permutation(hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])
                           if hi > lo]).astype(np.int64)


def _file_stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _cached_arrays(cache_dir: str, stem: str, description: dict, names: tuple, build, problem) -> tuple[list, bool]:
    """(arrays `names`, was_cache_hit): loaded from cache_dir, or build() (a tuple in the
    order of names) and saved there. File names carry a sha256 of the description, so any
    change of input lands in fresh files; atomic writes mean a crash or a concurrent rank
    never leaves a truncated .npy. Cached arrays are checked, problem(*arrays) (a file cut
    short or rewritten from outside would fail a read mid-run): damaged, they are rebuilt."""
    text = json.dumps(description, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    paths = [os.path.join(cache_dir, f"{stem}-{digest}-{n}.npy") for n in names]
    if all(os.path.isfile(p) for p in paths):
        try:
            arrays = [np.load(p, mmap_mode="r") for p in paths]
            why = problem(*arrays)
        except (ValueError, OSError, EOFError) as e:  # cut short, or not a .npy of numbers
            why = f"a file is not an array ({e})"
        if why is None:
            return arrays, True
        say(f"the sample-index cache {os.path.join(cache_dir, f'{stem}-{digest}-*.npy')} is damaged ({why}): "
            f"rebuilding it")
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    for path, array in zip(paths, arrays):
        atomic_write(path, lambda f, a=array: np.save(f, a))
    atomic_write(os.path.join(cache_dir, f"{stem}-{digest}-description.json"), lambda f: f.write(text.encode()))
    return arrays, False


def _layout_problem(name: str, array: np.ndarray, dtype, shape: tuple) -> str | None:
    """Where `array` is not of `dtype` and `shape` (None: any length), what it is."""
    if array.dtype == dtype and array.ndim == len(shape) and all(n in (None, m) for n, m in zip(shape, array.shape)):
        return None
    return f"{name} is {array.dtype} {array.shape}, not {np.dtype(dtype)} {tuple('N' if n is None else n for n in shape)}"


def _gpt_indices_problem(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                         doc_idx, sample_idx, shuffle_idx) -> str | None:
    """What build_gpt_indices would not have built, or None: doc_idx of these documents
    only; sample_idx build_sample_idx's of doc_idx; and shuffle_idx (at least num_samples
    long) naming samples that are there."""
    for name, array, shape in (("doc_idx", doc_idx, (None,)), ("sample_idx", sample_idx, (None, 2)),
                               ("shuffle_idx", shuffle_idx, (None,))):
        if problem := _layout_problem(name, array, np.int64, shape):
            return problem
    if not num_samples <= len(shuffle_idx) == len(sample_idx) - 1:
        return f"{len(shuffle_idx)} samples in shuffle_idx, {len(sample_idx) - 1} in sample_idx, {num_samples} asked"
    if not (0 <= shuffle_idx.min() and shuffle_idx.max() < len(shuffle_idx)):
        return "shuffle_idx names samples that are not there"
    if not np.isin(doc_idx, documents).all():
        return "doc_idx names documents that are not this split's"
    if not np.array_equal(sample_idx, build_sample_idx(sizes, doc_idx, seq_length, len(sample_idx) - 1)):
        return f"sample_idx is not the one doc_idx gives (a row each {seq_length} stream tokens)"
    return None


def _blend_problem(datasets: list, num_samples: int, dataset_index, dataset_sample_index) -> str | None:
    """What build_blending_indices would not have built, or None: num_samples picks, each
    of a dataset there and a sample it holds."""
    for name, array, dtype in (("dataset_index", dataset_index, np.int16),
                               ("dataset_sample_index", dataset_sample_index, np.int64)):
        if problem := _layout_problem(name, array, dtype, (num_samples,)):
            return problem
    if num_samples and not (0 <= dataset_index.min() and dataset_index.max() < len(datasets)):
        return "dataset_index names datasets that are not there"
    held = np.array([len(d) for d in datasets], dtype=np.int64)[dataset_index]
    if not ((0 <= dataset_sample_index) & (dataset_sample_index < held)).all():
        return "dataset_sample_index names samples that are not there"
    return None


def default_cache_dir(path_prefix: str) -> str:
    return path_prefix + "-cache"


class GPTDataset(torch.utils.data.Dataset):
    """num_samples samples of seq_length tokens over `documents` (sequence indices of
    `indexed`). Item i is a dict of (S,) tensors, S = seq_length: tokens, labels (tokens
    shifted by one), loss_mask (float; 0 where the input is EOD with eod_mask_loss),
    position_ids (restarting after each EOD with reset_position_ids) and, with
    reset_attention_mask, document_ids (each token's document: _document_starts)."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, cache_dir: str | None = None, eod_token: int = 50256,
                 reset_position_ids: bool = False, eod_mask_loss: bool = False, name: str = "train",
                 reset_attention_mask: bool = False):
        documents = np.asarray(documents, dtype=np.int64)  # some, with tokens (build_train_valid_test_datasets)
        self.indexed, self.name = indexed, name
        self.num_samples, self.seq_length = num_samples, seq_length
        self.eod_token, self.reset_position_ids, self.eod_mask_loss = eod_token, reset_position_ids, eod_mask_loss
        self.reset_attention_mask = reset_attention_mask
        prefix = indexed.path_prefix
        description = {
            "class": "GPTDataset", "version": _INDEX_CACHE_VERSION, "prefix": os.path.abspath(prefix),
            "idx": _file_stamp(prefix + ".idx"), "bin": _file_stamp(prefix + ".bin"),
            "documents": hashlib.sha256(documents.tobytes()).hexdigest(), "num_documents": len(documents),
            "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
        }
        arrays, self.cache_hit = _cached_arrays(
            cache_dir or default_cache_dir(prefix), f"gpt-{name}", description,
            ("doc_idx", "sample_idx", "shuffle_idx"),
            lambda: build_gpt_indices(indexed.sizes, documents, seq_length, num_samples, seed),
            lambda *cached: _gpt_indices_problem(indexed.sizes, documents, seq_length, num_samples, *cached))
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, j: int) -> np.ndarray:
        """The seq_length + 1 stream tokens of (unshuffled) sample j."""
        (d0, o0), (d1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        get, doc = self.indexed.get, self.doc_idx
        if d0 == d1:
            return np.array(get(int(doc[d0]), int(o0), int(o1 - o0 + 1)))
        parts = [get(int(doc[d0]), int(o0))]
        for d in range(d0 + 1, d1):  # whole documents in between
            parts.append(get(int(doc[d])))
        parts.append(get(int(doc[d1]), 0, int(o1 + 1)))
        return np.concatenate(parts)

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} sample {i} out of range [0, {self.num_samples})")
        sample = torch.from_numpy(self.sample_tokens(int(self.shuffle_idx[i])).astype(np.int64))  # (S+1,)
        tokens, labels = sample[:-1], sample[1:]                                                  # (S,)
        is_eod = tokens == self.eod_token
        loss_mask = (~is_eod).float() if self.eod_mask_loss else torch.ones(self.seq_length)
        position_ids = _reset_positions(is_eod) if self.reset_position_ids else torch.arange(self.seq_length)
        item = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)
        if self.reset_attention_mask:  # attention stays within each document (context.same_document)
            item["document_ids"] = _document_starts(is_eod)
        return item


def _document_starts(is_eod: torch.Tensor) -> torch.Tensor:
    """Each token's document, named by the index of its first token: a document
    starts after each EOD, which ends (belongs to) the one before:
    [a b EOD c d] -> [0 0 0 3 3]. Two tokens share a document iff equal."""
    starts = torch.zeros(is_eod.shape[0], dtype=torch.long)
    after_eod = torch.nonzero(is_eod[:-1]).flatten() + 1
    starts[after_eod] = after_eod
    return torch.cummax(starts, dim=0).values


def _reset_positions(is_eod: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 on the token after each EOD: [a b EOD c d] -> [0 1 2 0 1]."""
    return torch.arange(is_eod.shape[0]) - _document_starts(is_eod)


# ----------------------------------------------------------------------------
# 3. Blending corpora by weight, and the data-parallel sampler

def build_blending_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample i comes from the dataset whose count lags its
    target weight*i the most, so every prefix matches the weights as closely as whole
    samples allow. Returns (dataset_index int16 (N,), dataset_sample_index int64 (N,)).
    A plain Python loop (~1 s per 1e6 samples); the result is cached on disk."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    choice, sample = [0] * num_samples, [0] * num_samples
    for i in range(num_samples):
        t = max(float(i), 1.0)
        best, best_err = 0, w[0] * t - counts[0]
        for k in range(1, len(w)):
            err = w[k] * t - counts[k]
            if err > best_err:
                best, best_err = k, err
        choice[i], sample[i] = best, counts[best]  # the n-th pick of dataset k reads its sample n
        counts[best] += 1
    return np.asarray(choice, dtype=np.int16), np.asarray(sample, dtype=np.int64)


class BlendedDataset(torch.utils.data.Dataset):
    """num_samples samples drawn from several datasets in proportion to weights."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int,
                 cache_dir: str | None = None, name: str = "train"):
        total = float(sum(weights))
        self.datasets, self.weights, self.num_samples = datasets, [w / total for w in weights], num_samples
        # The blend order depends only on the weights and the length, not on the datasets.
        description = {"class": "BlendedDataset", "version": _INDEX_CACHE_VERSION, "weights": self.weights,
                       "num_samples": num_samples}
        cache_dir = cache_dir or default_cache_dir(datasets[0].indexed.path_prefix)
        arrays, self.cache_hit = _cached_arrays(cache_dir, f"blend-{name}", description,
                                                ("dataset_index", "dataset_sample_index"),
                                                lambda: build_blending_indices(self.weights, num_samples),
                                                lambda *cached: _blend_problem(datasets, num_samples, *cached))
        self.dataset_index, self.dataset_sample_index = arrays
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for k, (d, c) in enumerate(zip(self.datasets, counts)):
            if c > len(d):
                raise UsageError(f"blend needs {c} samples from dataset {k} but it only has {len(d)}; "
                                 "build it with more samples (weight * num_samples plus a margin)")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"blended sample {i} out of range [0, {self.num_samples})")
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float]]:
    """Megatron --data-path: ["A"] or ["0.3", "A", "0.7", "B"] -> (prefixes, normalized weights)."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    if len(data_path) == 1:
        return list(data_path), [1.0]
    if len(data_path) == 0 or len(data_path) % 2:
        raise UsageError(f"bad data path {data_path}: give one prefix, or weight/prefix pairs like "
                         "['0.3', 'A_text_document', '0.7', 'B_text_document']")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise UsageError(f"bad data path {data_path}: in a blend every other entry must be a number "
                         "(weight, prefix, weight, prefix, ...)") from None
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise UsageError(f"blend weights {weights} must be non-negative with a positive sum")
    pairs = [(p, w) for p, w in zip(data_path[1::2], weights) if w > 0]
    return [p for p, _ in pairs], [w / sum(weights) for _, w in pairs]


_SPLIT_NAMES = ("train", "valid", "test")
_BLEND_MARGIN = 0.005  # Megatron's surplus: children get 0.5% extra so the greedy blend never runs dry


def build_train_valid_test_datasets(data_path: list[str], split: str, num_samples, seq_length: int, seed: int,
                                    cache_dir: str | None = None, eod_token: int = 50256,
                                    reset_position_ids: bool = False, eod_mask_loss: bool = False,
                                    reset_attention_mask: bool = False):
    """(train, valid, test) datasets over a single corpus or a weighted blend; None
    where 0 samples are asked. Each corpus is split by document with `split`."""
    prefixes, weights = parse_blend(data_path)
    fractions = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    result = []
    for s, name in enumerate(_SPLIT_NAMES):
        n = int(num_samples[s])
        if n == 0:
            result.append(None)
            continue
        parts = []
        for ds, w in zip(indexed, weights):
            n_child = n if len(indexed) == 1 else int(math.ceil(math.ceil(n * w) * (1 + _BLEND_MARGIN)))
            bounds = split_boundaries(fractions, len(ds))
            documents = np.arange(bounds[s], bounds[s + 1], dtype=np.int64)
            if len(documents) == 0 or int(ds.sizes[documents].astype(np.int64).sum()) == 0:
                raise UsageError(f"the {name} split of {ds.path_prefix} gets {len(documents)} of its {len(ds)} "
                                 f"documents and no tokens (split fractions {[round(f, 4) for f in fractions]}), "
                                 f"but {n_child} {name} samples were asked for; add more documents, or give {name} "
                                 f"a larger share in --split" + (" (or none: no evaluation)" if name == "valid" else ""))
            parts.append(GPTDataset(ds, documents, n_child, seq_length, seed, cache_dir, eod_token,
                                    reset_position_ids, eod_mask_loss, name, reset_attention_mask))
        result.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, n, cache_dir, name))
    return tuple(result)


class PretrainingSampler:
    """Yields this rank's micro-batches of sample indices. Each block of micro_batch_size
    * data_parallel_size consecutive indices is one micro-step of all ranks, rank r taking
    the r-th slice. Starting at consumed_samples (over ALL ranks, as Megatron counts)
    resumes exactly; the incomplete tail block is dropped so all ranks run equally long.
    (The datasets are already shuffled, so the sampler need not be.)"""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if not 0 <= consumed_samples <= total_samples:  # a resume of a run with larger batches
            raise UsageError(f"consumed_samples={consumed_samples} must lie in [0, total_samples={total_samples}]; "
                             "was the checkpoint made with a larger dataset?")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.rank, self.world = micro_batch_size, data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.world)

    def __iter__(self):
        step = self.micro_batch_size * self.world
        first = self.consumed_samples + self.rank * self.micro_batch_size
        for start in range(first, first + len(self) * step, step):
            yield list(range(start, start + self.micro_batch_size))


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch of host tensors -> `device` (asynchronous from pinned memory)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ----------------------------------------------------------------------------
# 4. The vocabulary the tokens index: GPT-2's BPE
# ----------------------------------------------------------------------------
# prepare.py tokenizes with GPT-2's files; here is how any copy of them is
# recognized, so the flags that name them (--vocab-file, --merge-file) can be
# checked without the tokenizer.

VOCAB_SIZE = 50257  # true GPT-2 vocabulary (tokens ids 0..50256)

# Digests of gpt2-vocab.json and gpt2-merges.txt (key order and the "#version" line
# aside): they tell GPT-2's own files from any other tokenizer's.
GPT2_VOCAB_SHA256 = "855ec41a9d90094ebb1189ee8082e915505cf2dfe0691a4f39da9c020f9476b2"
GPT2_MERGES_SHA256 = "04e3597d7996f292ca9b8b7285ca4d58a6ae171ac47d73fc7140ceb0c7a6bbc0"


def vocab_digest(vocab) -> str:
    return hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()


def check_gpt2_bpe(tokenizer_type: str, vocab_file: str | None = None,
                   merge_file: str | None = None) -> None:
    """Megatron recipes name the tokenizer and its files: they must be GPT2BPETokenizer and,
    where given, GPT-2's files (tokenization uses the installed copy, gpt2_bpe_files)."""
    if tokenizer_type != "GPT2BPETokenizer":  # (train.py's NullTokenizer has no text to tokenize)
        raise UsageError(f"--tokenizer-type {tokenizer_type} is not supported; only GPT2BPETokenizer "
                         f"(GPT-2's BPE, {VOCAB_SIZE} tokens) tokenizes text here (train.py and "
                         f"eval_tasks.py also take ids: NullTokenizer --vocab-size N)")
    other = "this project tokenizes with GPT-2's BPE only (gpt2-vocab.json / gpt2-merges.txt)"
    most = 16 << 20  # bytes: GPT-2's vocab and merges are 1 MB and 0.5 MB; no FIFO or /dev/zero is read forever
    if vocab_file:
        vocab = parse_json(text_file(vocab_file, most, "--vocab-file "), f"--vocab-file {vocab_file}")
        if vocab_digest(vocab) != GPT2_VOCAB_SHA256:
            size = len(vocab) if isinstance(vocab, dict) else "not a dict of"
            raise UsageError(f"--vocab-file {vocab_file} is not GPT-2's vocabulary ({size} entries; "
                             f"GPT-2 has {VOCAB_SIZE}): {other}")
    if merge_file:
        merges = [line for line in text_file(merge_file, most, "--merge-file ").splitlines()
                  if line and not line.startswith("#version")]
        if hashlib.sha256("\n".join(merges).encode()).hexdigest() != GPT2_MERGES_SHA256:
            raise UsageError(f"--merge-file {merge_file} is not GPT-2's merges ({len(merges)} merges; "
                             f"GPT-2 has 50000): {other}")
