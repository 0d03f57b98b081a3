"""Tests for data.py: Megatron .bin/.idx compatibility, GPT sample indexing, blending, sampler."""
import os
import pickle
import warnings

import numpy as np
import pytest
import torch

from data import (BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetBuilder, PretrainingSampler,
                  best_dtype, build_blending_indices, build_train_valid_test_datasets, parse_blend, parse_split,
                  split_boundaries)
from launch import UsageError

pytestmark = pytest.mark.quick  # the whole file is in the quick tier (tests/conftest.py)


EOD = 50256


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def random_docs(n, seed=0, max_len=40, vocab=50000, eod=EOD):
    """Documents of random length (some empty) ending in EOD, like prepare.py writes."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        body = rng.integers(0, vocab, rng.integers(0, max_len))
        docs.append(np.append(body, eod) if len(body) else body)
    return docs


def write_corpus(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for d in docs:
        builder.add_document(d)
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------- indexed format

@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_are_byte_identical_to_megatron_core(tmp_path, dtype):
    M = _megatron()
    docs = random_docs(30)
    ours = write_corpus(tmp_path / "ours", docs, dtype)
    theirs = M.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for d in docs:
        theirs.add_document(torch.tensor(d), [len(d)])
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert read_bytes(ours + ext) == read_bytes(str(tmp_path / "theirs") + ext)


def test_megatron_core_reads_our_files_and_we_read_theirs(tmp_path):
    M = _megatron()
    docs = random_docs(25, seed=1)
    prefix = write_corpus(tmp_path / "c", docs)
    theirs, ours = M.IndexedDataset(prefix), IndexedDataset(prefix)
    assert len(theirs) == len(ours) == len(docs)
    assert ours.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
        np.testing.assert_array_equal(ours[i], d)
    np.testing.assert_array_equal(ours.get(3, offset=1, length=2), docs[3][1:3])
    np.testing.assert_array_equal(ours.doc_idx, np.arange(len(docs) + 1))
    assert ours.dtype == np.uint16 and ours.sizes.dtype == np.int32 and ours.pointers.dtype == np.int64


def test_merge_equals_single_build_and_megatron_add_index(tmp_path):
    M = _megatron()
    docs = random_docs(20, seed=2)
    whole = write_corpus(tmp_path / "whole", docs)
    a = write_corpus(tmp_path / "a", docs[:7])
    b = write_corpus(tmp_path / "b", docs[7:])
    merged = IndexedDatasetBuilder(str(tmp_path / "merged.bin"))
    merged.add_index(a)
    merged.add_index(b)
    merged.finalize(str(tmp_path / "merged.idx"))
    theirs = M.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    theirs.add_index(a)
    theirs.add_index(b)
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert read_bytes(str(tmp_path / "merged") + ext) == read_bytes(whole + ext)
        assert read_bytes(str(tmp_path / "theirs") + ext) == read_bytes(whole + ext)


def test_merge_with_other_dtype_is_refused(tmp_path):
    a = write_corpus(tmp_path / "a", random_docs(3), np.int32)
    with IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16) as builder:
        with pytest.raises(ValueError, match="int32.*uint16"):
            builder.add_index(a)
        builder.abort()


def test_truncated_bin_names_expected_and_actual_bytes(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(10))
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(ValueError, match=f"{size} bytes.*{size - 2} bytes.*re-run prepare.py"):
        IndexedDataset(prefix)


def test_bad_magic_and_wrong_idx_length_are_reported(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(10))
    good = read_bytes(prefix + ".idx")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"NOTANIDX!" + good[9:])
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(good[:-8])
    with pytest.raises(ValueError, match=f"{len(good)} bytes.*{len(good) - 8} bytes"):
        IndexedDataset(prefix)


def test_missing_files_suggest_prepare(tmp_path):
    with pytest.raises(UsageError, match="nope.idx.*prepare.py"):
        IndexedDataset(str(tmp_path / "nope"))


def test_crash_mid_build_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetBuilder(str(tmp_path / "c.bin")) as builder:
            builder.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    # Before finalize() only temp files exist, so a killed process leaves no .bin/.idx pair.
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"))
    builder.add_document([1, 2, 3])
    assert os.listdir(tmp_path) == ["c.bin.tmp"]
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_tokens_out_of_dtype_range_are_refused(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "c.bin"), np.uint16) as builder:
        with pytest.raises(ValueError, match="70000.*uint16"):
            builder.add_document([1, 70000])
        builder.abort()
    assert best_dtype(50257) == np.uint16 and best_dtype(100277) == np.int32


def test_dataset_pickles_for_dataloader_workers(tmp_path):
    docs = random_docs(5)
    ds = pickle.loads(pickle.dumps(IndexedDataset(write_corpus(tmp_path / "c", docs))))
    np.testing.assert_array_equal(ds[4], docs[4])


# ---------------------------------------------------------------- GPT samples

def gpt(prefix, num_samples, seq_length, seed=1234, cache_dir=None, docs=None, **kw):
    ds = IndexedDataset(prefix)
    documents = np.arange(len(ds)) if docs is None else docs
    return GPTDataset(ds, documents, num_samples, seq_length, seed, cache_dir, **kw)


@pytest.mark.parametrize("seq_length,num_samples", [(3, 50), (8, 40), (64, 30), (100, 60)])
def test_samples_match_brute_force_flattening(tmp_path, seq_length, num_samples):
    """Sample j is stream tokens [j*S, j*S+S] of the doc_idx-ordered stream, across
    document boundaries and epochs (S=64/100 exceed any document; 60*100 tokens need several epochs)."""
    docs = random_docs(40, seed=3)
    ds = gpt(write_corpus(tmp_path / "c", docs), num_samples, seq_length, cache_dir=str(tmp_path / "cache"))
    stream = []
    for d in ds.doc_idx:
        stream.extend(docs[d].tolist())
    for j in range(len(ds.shuffle_idx)):
        np.testing.assert_array_equal(ds.sample_tokens(j), stream[j * seq_length:(j + 1) * seq_length + 1])
    item = ds[5]
    expected = np.array(stream[ds.shuffle_idx[5] * seq_length:][:seq_length + 1])
    np.testing.assert_array_equal(item["tokens"], expected[:-1])
    np.testing.assert_array_equal(item["labels"], expected[1:])
    assert item["tokens"].dtype == torch.long and item["loss_mask"].dtype == torch.float32
    assert len(ds) == num_samples and sorted(ds.shuffle_idx) == list(range(len(ds.shuffle_idx)))


def test_sample_idx_matches_megatron_core_helper(tmp_path):
    _megatron()
    from megatron.core.datasets import helpers_cpp
    docs = random_docs(30, seed=4)
    ds = gpt(write_corpus(tmp_path / "c", docs), 80, 16, cache_dir=str(tmp_path / "cache"))
    sizes = ds.indexed.sizes
    tokens_per_epoch = int(sizes.sum())
    epochs = len(ds.doc_idx) // len(docs)
    theirs = helpers_cpp.build_sample_idx_int64(sizes, ds.doc_idx.astype(np.int32), 16, epochs,
                                                tokens_per_epoch, True, 1)
    np.testing.assert_array_equal(ds.sample_idx, theirs)


def test_samples_equal_megatron_core_gpt_dataset_within_one_epoch(tmp_path):
    """While a split fits in one epoch, sample i is megatron-core's sample i, token
    for token (same seed, same document and sample shuffles). Beyond one epoch the
    orders part: each epoch is shuffled on its own here (docs/megatron.md)."""
    _megatron()
    from megatron.core.datasets.gpt_dataset import GPTDataset as TheirGPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as TheirIndexedDataset
    from megatron.core.datasets.utils import Split

    class Tokenizer:  # what megatron-core's GPTDataset asks of a tokenizer
        eod, pad, vocab_size = EOD, -1, 50257
        unique_identifiers = {"class": "Tokenizer"}

    docs = random_docs(200, seed=0)
    prefix = str(write_corpus(tmp_path / "c", docs))
    num_samples = (sum(len(d) for d in docs) - 1) // 16 - 5  # just under one epoch
    config = GPTDatasetConfig(random_seed=1234, sequence_length=16, split="1,0,0", tokenizer=Tokenizer(),
                              path_to_cache=str(tmp_path / "theirs"), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)
    theirs = TheirGPTDataset(TheirIndexedDataset(prefix), prefix, np.arange(len(docs), dtype=np.int32),
                             num_samples, Split.train, config)
    ours = gpt(prefix, num_samples, 16, cache_dir=str(tmp_path / "ours"))
    for i in range(num_samples):
        np.testing.assert_array_equal(np.asarray(theirs[i]["tokens"]), ours[i]["tokens"].numpy())
        np.testing.assert_array_equal(np.asarray(theirs[i]["labels"]), ours[i]["labels"].numpy())


def test_dataloader_workers_batch_samples(tmp_path):
    ds = gpt(write_corpus(tmp_path / "c", random_docs(30, seed=13)), 12, 8, cache_dir=str(tmp_path / "cache"))
    sampler = PretrainingSampler(len(ds), 0, 4, data_parallel_rank=1, data_parallel_size=2)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=1)
    batches = list(loader)
    assert len(batches) == 1 and batches[0]["tokens"].shape == (4, 8)
    assert torch.equal(batches[0]["labels"][2], ds[6]["labels"])  # rank 1 holds samples 4..7


def test_first_epoch_visits_every_document_and_token(tmp_path):
    docs = random_docs(30, seed=5)
    seq_length = 8
    total = sum(len(d) for d in docs)
    one_epoch = (total - 1) // seq_length
    ds = gpt(write_corpus(tmp_path / "c", docs), one_epoch, seq_length, cache_dir=str(tmp_path / "cache"))
    assert sorted(ds.doc_idx.tolist()) == list(range(30))  # exactly one epoch built
    seen = sum(len(ds[i]["tokens"]) for i in range(len(ds)))  # inputs of different samples never overlap
    assert seen == one_epoch * seq_length and total - seen <= seq_length  # only a tail < S is left out
    two = gpt(ds.indexed.path_prefix, one_epoch + 1, seq_length, cache_dir=str(tmp_path / "cache"))
    assert sorted(two.doc_idx[:30].tolist()) == sorted(two.doc_idx[30:].tolist()) == list(range(30))


def test_a_run_of_1_1_epochs_reads_every_document_before_any_twice(tmp_path):
    """Samples are shuffled within their epoch: the first epoch's worth of
    samples covers every document (a shuffle over both built epochs would
    leave ~20% unread and repeat others), and the extra 0.1 epoch comes after."""
    docs = random_docs(200, seed=8)
    seq_length = 16
    total = sum(len(d) for d in docs)
    one_epoch = (total - 1) // seq_length
    ds = gpt(write_corpus(tmp_path / "c", docs), int(1.1 * one_epoch), seq_length,
             cache_dir=str(tmp_path / "cache"))
    assert len(ds.doc_idx) == 400  # two epochs built

    def documents_read(samples):
        read = set()
        for i in samples:
            (pos, _), (end_pos, _) = ds.sample_idx[ds.shuffle_idx[i]], ds.sample_idx[ds.shuffle_idx[i] + 1]
            read.update(ds.doc_idx[pos:end_pos + 1].tolist())
        return read

    assert documents_read(range(one_epoch)) == set(range(200))
    first = -(-total // seq_length)  # samples that start in the first epoch
    assert sorted(ds.shuffle_idx[:first]) == list(range(first))
    assert min(ds.shuffle_idx[first:len(ds)]) >= first  # then the second epoch's


def test_indices_are_deterministic_and_seed_dependent(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(30, seed=6))
    a = gpt(prefix, 40, 8, seed=1, cache_dir=str(tmp_path / "c1"))
    b = gpt(prefix, 40, 8, seed=1, cache_dir=str(tmp_path / "c2"))
    c = gpt(prefix, 40, 8, seed=2, cache_dir=str(tmp_path / "c3"))
    assert not b.cache_hit
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)


def test_cache_is_reused_and_invalidated_by_any_input_change(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(30, seed=7))
    cache = str(tmp_path / "cache")
    first = gpt(prefix, 40, 8, cache_dir=cache)
    files = sorted(os.listdir(cache))
    again = gpt(prefix, 40, 8, cache_dir=cache)
    assert not first.cache_hit and again.cache_hit and sorted(os.listdir(cache)) == files
    np.testing.assert_array_equal(first.shuffle_idx, again.shuffle_idx)
    assert not gpt(prefix, 40, 16, cache_dir=cache).cache_hit  # seq_length
    assert not gpt(prefix, 41, 8, cache_dir=cache).cache_hit   # num_samples
    write_corpus(tmp_path / "c", random_docs(30, seed=8))       # the data itself was rebuilt
    os.utime(prefix + ".bin", ns=(1, 1))
    assert not gpt(prefix, 40, 8, cache_dir=cache).cache_hit
    assert not any(".tmp" in f for f in os.listdir(cache))


def test_default_cache_dir_sits_next_to_the_data(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(10))
    gpt(prefix, 5, 4)
    assert any(f.endswith("shuffle_idx.npy") for f in os.listdir(prefix + "-cache"))


def test_splits_are_disjoint_by_document(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(100, seed=9))
    train, valid, test = build_train_valid_test_datasets([prefix], "8,1,1", (50, 10, 10), 8, 1234)
    sets = [set(d.doc_idx.tolist()) for d in (train, valid, test)]
    assert sets[0] == set(range(80)) and sets[1] == set(range(80, 90)) and sets[2] == set(range(90, 100))
    assert build_train_valid_test_datasets([prefix], "8,2", (5, 0, 0), 8, 1)[1:] == (None, None)


def test_split_parsing_and_megatron_rounding():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1/1") == pytest.approx([0.5, 0.5, 0.0])
    assert split_boundaries(parse_split("969,30,1"), 1000) == [0, 969, 999, 1000]
    assert split_boundaries(parse_split("1,1,1"), 10) == [0, 3, 7, 10]  # round(3.33)=3, round(6.67)=7
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0"):
        with pytest.raises(ValueError, match="bad split"):
            parse_split(bad)


def test_empty_split_asked_for_samples_is_a_clear_error(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(5, seed=10))
    with pytest.raises(ValueError, match="valid split .* gets 0 of its 5 documents.*add more documents"):
        build_train_valid_test_datasets([prefix], "99,1,0", (10, 10, 0), 8, 1234)


def test_eod_mask_loss_reset_position_ids_and_reset_attention_mask(tmp_path):
    """Positions restart after each EOD, which has no loss; document_ids (with
    --reset-attention-mask alone) name each token's document by its first
    token, the EOD counted in the document it ends."""
    docs = [np.array([1, 2, EOD]), np.array([3, 4, 5, 6, EOD]), np.array([7, EOD])]
    prefix = write_corpus(tmp_path / "c", docs)
    kw = dict(cache_dir=str(tmp_path / "cache"), docs=np.arange(3))
    plain = gpt(prefix, 1, 9, **kw)[0]
    assert plain["loss_mask"].tolist() == [1.0] * 9 and plain["position_ids"].tolist() == list(range(9))
    assert "document_ids" not in plain
    item = gpt(prefix, 1, 9, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True, **kw)[0]
    tokens = item["tokens"].tolist()
    eod_at = [k for k, t in enumerate(tokens) if t == EOD]
    assert item["loss_mask"].tolist() == [0.0 if k in eod_at else 1.0 for k in range(9)]
    expected, pos = [], 0
    for t in tokens:  # positions restart right after each EOD
        expected.append(pos)
        pos = 0 if t == EOD else pos + 1
    assert item["position_ids"].tolist() == expected and len(eod_at) >= 2
    first = [k - p for k, p in enumerate(expected)]  # the index of each token's document's first token
    assert item["document_ids"].tolist() == first and item["document_ids"].dtype == torch.long



def test_positions_loss_mask_and_document_masks_are_megatrons(tmp_path):
    """With --reset-position-ids, --eod-mask-loss and --reset-attention-mask,
    each packed sample's positions and loss mask are megatron-core's, and its
    documents' causal mask (context.same_document) is Megatron's attention
    mask (True there where a token may not attend)."""
    _megatron()
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    import context
    prefix = str(write_corpus(tmp_path / "c", random_docs(60, seed=3, max_len=12)))
    ours = gpt(prefix, 20, 16, cache_dir=str(tmp_path / "cache"), reset_position_ids=True, eod_mask_loss=True,
               reset_attention_mask=True)
    for i in range(len(ours)):
        item = ours[i]
        mask, loss_mask, positions = _get_ltor_masks_and_position_ids(item["tokens"], EOD, True, True, True, True)
        assert torch.equal(item["position_ids"], positions) and torch.equal(item["loss_mask"], loss_mask)
        ids = item["document_ids"][None]  # (1, S)
        assert torch.equal(context.same_document(ids, ids, causal=True)[0], ~mask), i

# ---------------------------------------------------------------- blending and sampler

def test_blending_indices_match_megatron_and_weights():
    _megatron()
    from megatron.core.datasets import helpers_cpp
    weights, n = [0.2, 0.3, 0.5], 20000
    index, sample = build_blending_indices(weights, n)
    theirs_index, theirs_sample = np.zeros(n, np.int16), np.zeros(n, np.int64)
    helpers_cpp.build_blending_indices(theirs_index, theirs_sample, np.array(weights), 3, n, False)
    np.testing.assert_array_equal(index, theirs_index)
    np.testing.assert_array_equal(sample, theirs_sample)
    for prefix_len in (1000, n):  # every prefix follows the weights
        counts = np.bincount(index[:prefix_len], minlength=3) / prefix_len
        np.testing.assert_allclose(counts, weights, atol=0.01)


def test_blended_dataset_end_to_end(tmp_path):
    a = write_corpus(tmp_path / "a", random_docs(40, seed=11, vocab=1000))
    b = write_corpus(tmp_path / "b", random_docs(40, seed=12, vocab=1000))
    with pytest.raises(ValueError, match="weight, prefix"):
        build_train_valid_test_datasets(["0.3", a, "x", b], "1", (10, 0, 0), 8, 1)
    with pytest.raises(ValueError, match="bad data path"):
        build_train_valid_test_datasets(["0.3", a, "0.7"], "1", (10, 0, 0), 8, 1)
    cache = str(tmp_path / "cache")
    train, _, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "1", (200, 0, 0), 8, 1, cache_dir=cache)
    assert isinstance(train, BlendedDataset) and len(train) == 200
    np.testing.assert_allclose(np.bincount(train.dataset_index) / 200, [0.3, 0.7], atol=0.01)
    k, j = int(train.dataset_index[17]), int(train.dataset_sample_index[17])
    assert torch.equal(train[17]["tokens"], train.datasets[k][j]["tokens"])
    again, _, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "1", (200, 0, 0), 8, 1, cache_dir=cache)
    assert again.cache_hit and np.array_equal(again.dataset_index, train.dataset_index)
    assert parse_blend(["2", "x", "6", "y"]) == (["x", "y"], [0.25, 0.75])


def take(sampler):
    return [i for batch in sampler for i in batch]


def test_sampler_ranks_are_disjoint_and_cover_the_global_order():
    total, mb, dp = 103, 4, 3  # 103 = 8 full micro-steps of 12 samples + a dropped tail of 7
    per_rank = [list(PretrainingSampler(total, 0, mb, r, dp)) for r in range(dp)]
    assert all(len(batches) == 8 and all(len(b) == mb for b in batches) for batches in per_rank)
    assert per_rank[1][0] == [4, 5, 6, 7] and per_rank[2][1] == [20, 21, 22, 23]
    every = sorted(i for batches in per_rank for b in batches for i in b)
    assert every == list(range(96))


def test_sampler_resumes_exactly_from_consumed_samples():
    full = [take(PretrainingSampler(100, 0, 2, r, 2)) for r in range(2)]
    resumed = [take(PretrainingSampler(100, 40, 2, r, 2)) for r in range(2)]
    for r in range(2):
        assert resumed[r] == full[r][20:]  # 40 consumed globally = 20 per rank
    assert len(PretrainingSampler(100, 100, 2, 0, 2)) == 0


def test_sampler_refuses_to_start_past_its_samples():
    with pytest.raises(ValueError, match="consumed"):
        PretrainingSampler(10, 11, 1, 0, 1)
