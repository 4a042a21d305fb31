"""Training samples: windows against a naive reference, blends against weights and Megatron, seeds, resume, caching."""

from __future__ import annotations

import os
import pickle
import threading
import warnings

import numpy as np
import pytest

from llmjp_ds.data.dataset import (CACHE_DIR_NAME, blend_assignment, build_datasets, build_window_index,
                                   parse_blend)
from llmjp_ds.data.indexed import IndexedDataset
from llmjp_ds.errors import UserError

from .data_helpers import labelled_corpus, random_documents, write_corpus

SEQ = 32


def _naive_windows(docs, seq_len, seed, split_id, epochs):
    """The documented algorithm, one document and one window at a time."""
    stream: list[int] = []
    for e in range(epochs):
        for d in np.random.default_rng([seed, split_id, e]).permutation(len(docs)):
            stream.extend(docs[d].tolist())
    per_epoch = (sum(len(d) for d in docs) - 1) // seq_len
    windows = [stream[j * seq_len: j * seq_len + seq_len + 1] for j in range(epochs * per_epoch)]
    out = []
    for b in range(epochs):
        for p in np.random.default_rng([seed, split_id, b, 1]).permutation(per_epoch):
            out.append(windows[b * per_epoch + p])
    return out


@pytest.fixture
def corpus(tmp_path):
    docs = random_documents(np.random.default_rng(0), 200, 2000, max_len=120)
    return write_corpus(tmp_path / "c", docs), docs


def test_windows_equal_naive_reference(corpus):
    prefix, docs = corpus
    per_epoch = (sum(map(len, docs[:198])) - 1) // SEQ
    train_samples = int(per_epoch * 2.5)  # three epochs
    train, _ = build_datasets([prefix], SEQ, seed=7, train_samples=train_samples, valid_samples=0)
    assert len(train) == train_samples
    reference = _naive_windows(docs[:198], SEQ, 7, 0, 3)  # split 0.99/0.01 of 200 documents: 198 train
    for i in range(train_samples):
        sample = train[i]
        assert sample.dtype == np.int64 and sample.shape == (SEQ + 1,)
        assert sample.tolist() == reference[i]


def test_window_index_matches_reference_with_empty_documents():
    lengths = np.array([0, 5, 0, 0, 17, 1, 0, 40, 3, 0], dtype=np.int64)
    docs = [np.arange(n) + 100 * d for d, n in enumerate(lengths)]
    index = build_window_index(lengths, 8, seed=3, split_id=0, epochs=2)
    for j, want in enumerate(_naive_windows(docs, 8, 3, 0, 2)):
        p, skip, got = int(index["doc"][j]), int(index["offset"][j]), []
        while len(got) < 9:
            d = int(index["order"][p])
            got += docs[d][skip:].tolist()
            p, skip = p + 1, 0
        assert got[:9] == want


def test_split_is_by_documents(tmp_path):
    """Document d holds only the token 10 + d, so a sample shows which documents it came from."""
    prefix = labelled_corpus(tmp_path / "lab", [50] * 100)
    train, valid = build_datasets([prefix], SEQ, seed=1, train_samples=500, valid_samples=50, split=(0.9, 0.1))
    train_docs = {int(t) - 10 for i in range(len(train)) for t in train[i]}
    valid_docs = {int(t) - 10 for i in range(len(valid)) for t in valid[i]}
    assert train_docs == set(range(90)) and valid_docs == set(range(90, 100))


def test_each_epoch_sees_every_document_once(tmp_path):
    prefix = labelled_corpus(tmp_path / "lab", [SEQ] * 64)  # 2,048 tokens: 63 windows an epoch
    train, _ = build_datasets([prefix], SEQ, seed=5, train_samples=63 * 3, valid_samples=0, split=(1, 0))
    first = np.concatenate([train[i][:-1] for i in range(63)]) - 10  # windows overlap by one token
    counts = np.bincount(first, minlength=64)
    assert counts.sum() == 63 * SEQ and counts.max() <= SEQ  # no document twice within the first epoch
    three = np.bincount(np.concatenate([train[i][:-1] for i in range(63 * 3)]) - 10, minlength=64)
    assert three.min() >= 2 * SEQ and three.max() <= 3 * SEQ  # epochs 0 and 1 whole, part of epoch 2


def test_same_seed_same_order_different_seed_different_order(corpus, tmp_path):
    prefix, _ = corpus
    a, va = build_datasets([prefix], SEQ, seed=11, train_samples=300, valid_samples=5)
    b, vb = build_datasets([prefix], SEQ, seed=11, train_samples=300, valid_samples=5, cache_dir=tmp_path / "other")
    c, _ = build_datasets([prefix], SEQ, seed=12, train_samples=300, valid_samples=5)
    assert all(np.array_equal(a[i], b[i]) for i in range(300))
    assert all(np.array_equal(va[i], vb[i]) for i in range(5))
    differing = sum(not np.array_equal(a[i], c[i]) for i in range(300))
    assert differing > 290


def test_resume_from_consumed_samples(corpus, tmp_path):
    """Samples consumed after a restart (fresh process state, cache reused or rebuilt) continue the same stream."""
    prefix, _ = corpus
    uninterrupted, _ = build_datasets([prefix], SEQ, seed=3, train_samples=1000, valid_samples=0)
    stream = [uninterrupted[i] for i in range(1000)]
    consumed = 437
    resumed, _ = build_datasets([prefix], SEQ, seed=3, train_samples=1000, valid_samples=0)  # from the cache
    rebuilt, _ = build_datasets([prefix], SEQ, seed=3, train_samples=1000, valid_samples=0, cache_dir=tmp_path / "new")
    for i in range(consumed, 1000):
        assert np.array_equal(resumed[i], stream[i]) and np.array_equal(rebuilt[i], stream[i])
    # a longer run (more train_samples) keeps every sample of the shorter one: extending a run is safe
    longer, _ = build_datasets([prefix], SEQ, seed=3, train_samples=2500, valid_samples=0)
    assert all(np.array_equal(longer[i], stream[i]) for i in range(1000))


def _blend(tmp_path, weights=(0.5, 0.3, 0.2)):
    prefixes = [labelled_corpus(tmp_path / f"c{c}", [40] * 30, label_base=1000 * (c + 1)) for c in range(len(weights))]
    items = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    return parse_blend(items), prefixes


def test_blend_frequencies_match_weights(tmp_path):
    blend, _ = _blend(tmp_path)
    train, _ = build_datasets(blend, SEQ, seed=0, train_samples=10_000, valid_samples=0, split=(1, 0))
    corpus_of_sample = np.array([int(train[i][0]) // 1000 - 1 for i in range(10_000)])  # from the tokens
    assert np.array_equal(corpus_of_sample, [train.source(i)[0] for i in range(10_000)])
    counts = np.bincount(corpus_of_sample, minlength=3)
    assert np.abs(counts - np.array([5000, 3000, 2000])).max() <= 1
    # and at every prefix, not only at the end
    running = np.eye(3)[corpus_of_sample].cumsum(0)
    ideal = np.outer(np.arange(1, 10_001), [0.5, 0.3, 0.2])
    assert np.abs(running - ideal).max() <= 1.0


def test_blend_assignment_close_to_megatron_greedy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers_cpp

    weights = np.array([609, 182, 83, 63, 5.5, 3.9, 4.7, 763, 237, 2.7, 2.6, 1.8, 114.0])  # LLM-jp exp2, in B tokens
    weights /= weights.sum()
    n = 10_000
    theirs = np.zeros(n, np.int16)
    helpers_cpp.build_blending_indices(theirs, np.zeros(n, np.int64), weights, len(weights), n, False)
    ours, index = blend_assignment(weights, n, chunk=777)  # small chunks exercise the chunked merge
    mine, megatron = np.eye(len(weights))[ours].cumsum(0), np.eye(len(weights))[theirs].cumsum(0)
    assert np.abs(mine - megatron).max() <= 2
    assert np.abs(mine - np.outer(np.arange(1, n + 1), weights)).max() <= 2
    for c in range(len(weights)):  # each corpus's samples are taken in order 0, 1, 2, ...
        assert np.array_equal(index[ours == c], np.arange((ours == c).sum()))
    assert np.array_equal(blend_assignment(weights, n)[0], ours)  # chunking does not change the result


def test_blend_is_deterministic_and_prefix_stable(tmp_path):
    blend, _ = _blend(tmp_path)
    a, _ = build_datasets(blend, SEQ, seed=4, train_samples=2000, valid_samples=0, split=(1, 0))
    b, _ = build_datasets(blend, SEQ, seed=4, train_samples=5000, valid_samples=0, split=(1, 0))
    assert all(np.array_equal(a[i], b[i]) for i in range(2000))


def test_parse_blend(tmp_path):
    (pa, pb) = [labelled_corpus(tmp_path / n, [10] * k) for n, k in (("a", 3), ("b", 5))]
    assert parse_blend([pa]) == [(1.0, pa)]
    assert parse_blend([pa + ".bin"]) == [(1.0, pa)]
    assert parse_blend(["0.3", pa, "7", pb]) == [(0.3, pa), (7.0, pb)]
    assert parse_blend(f"0.3 {pa} 7 {pb}") == [(0.3, pa), (7.0, pb)]
    assert parse_blend([pa, pb]) == [(30.0, pa), (50.0, pb)]  # no weights: token counts, as LLM-jp
    cases = [
        (["0.3", pa, "0.7"], "3 items: give pairs"),
        (["x", pa, "0.7", pb], "data blend item .* is a number where a corpus prefix should be|is not a number"),
        (["-1", pa], "must be a finite number >= 0"),
        (["0", pa, "0", pb], "every data blend weight is 0"),
        (["1", str(tmp_path / "missing")], "missing.bin, .*missing.idx not found"),
        (["1", str(tmp_path / "a_text")], "not found"),
        ([], "empty data blend"),
    ]
    for items, pattern in cases:
        with pytest.raises(UserError, match=pattern):
            parse_blend(items)
    labelled_corpus(tmp_path / "z_text_document", [10])
    with pytest.raises(UserError, match="did you mean the _text_document prefix"):
        parse_blend([str(tmp_path / "z")])


def test_dataset_errors(tmp_path):
    small = labelled_corpus(tmp_path / "s", [5] * 4)
    with pytest.raises(UserError, match=r"train split of corpus .* has 20 tokens, fewer than one sample of seq_len \+"):
        build_datasets([small], 64, seed=0, train_samples=10, valid_samples=0, split=(1, 0))
    with pytest.raises(UserError, match="valid split .* has 5 tokens"):
        build_datasets([small], 8, seed=0, train_samples=10, valid_samples=10, split=(0.75, 0.25))
    with pytest.raises(UserError, match="contains token id 13, outside the model's vocabulary of 12"):
        build_datasets([small], 4, seed=0, train_samples=1, valid_samples=0, vocab_size=12)
    build_datasets([small], 4, seed=0, train_samples=1, valid_samples=0, vocab_size=14)
    with pytest.raises(UserError, match="split .* must be 2 or 3 fractions"):
        build_datasets([small], 4, seed=0, train_samples=1, valid_samples=0, split=(1,))


def test_cache_is_atomic_and_shared_by_concurrent_builders(tmp_path, corpus):
    """Two ranks (threads here) with a barrier: rank 0 builds, rank 1 waits and loads the same index."""
    prefix, _ = corpus
    barrier = threading.Barrier(2)
    results, order = {}, []

    def rank(r):
        train, _ = build_datasets([prefix], SEQ, seed=9, train_samples=400, valid_samples=0, barrier=barrier.wait,
                                  rank=r, cache_dir=tmp_path / "cache")
        order.append(r)
        results[r] = [train[i] for i in range(400)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(np.array_equal(x, y) for x, y in zip(results[0], results[1]))
    entries = sorted(os.listdir(tmp_path / "cache"))
    built = [e for e in entries if not e.startswith(".")]
    assert len(built) == 1 and all(not e.endswith(".tmp") for e in entries)

    # without a barrier, processes racing on the same cache end up with one complete index too
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=build_datasets, args=([prefix], SEQ, 10, 400, 0),
                         kwargs={"cache_dir": tmp_path / "race"}) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    entries = os.listdir(tmp_path / "race")
    assert len([e for e in entries if not e.startswith(".")]) == 1 and not any(e.endswith(".tmp") for e in entries)


def test_default_cache_is_beside_the_data_and_pickles_small(corpus):
    prefix, _ = corpus
    train, valid = build_datasets([prefix], SEQ, seed=2, train_samples=1000, valid_samples=3)
    assert os.path.isdir(os.path.join(os.path.dirname(prefix), CACHE_DIR_NAME))
    blob = pickle.dumps(train)
    assert len(blob) < 20_000  # index arrays travel as their cache path, the corpus as its prefix
    clone = pickle.loads(blob)
    assert all(np.array_equal(clone[i], train[i]) for i in range(0, 1000, 7))
    assert isinstance(clone.sources[0].corpus, IndexedDataset)
    with pytest.raises(IndexError):
        train[1000]
