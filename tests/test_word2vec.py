"""The english-word2vec task: skip-gram examples, the SGNS model and the embedding scores."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from adasum.experiments import embeddings
from adasum.experiments.data import Dataset, skipgram_examples
from adasum.experiments.embeddings import (
    EmbeddingScores,
    analogy_accuracy,
    eval_dir,
    ranks,
    similarity_score,
    spearman,
)
from adasum.experiments.models import SkipGramNegative
from adasum.experiments.runner import RunConfig, train
from adasum.sim import cross_entropy


def _pairs(x, y):
    """(center, context) of each example: the context sits at place y among the candidates."""
    return [(int(row[0]), int(row[1 + at])) for row, at in zip(x, y)]


def _examples(tokens, blocks=None, test=None, **kw):
    options = dict(vocab=50, window=2, negatives=3, subsample=0.0, seed=0)
    options.update(kw)
    blocks = np.zeros(len(tokens), int) if blocks is None else np.asarray(blocks)
    test = np.array([False] * (blocks.max() + 1)) if test is None else np.asarray(test)
    return skipgram_examples(tokens, blocks, test, **options)


def test_window_pairs_both_directions_with_word2vecs_weights():
    tokens = [f"w{i}" for i in range(200)]  # every word once: pairs are told apart by their ids
    text, (x, y), _ = _examples(tokens, vocab=200, window=3, seed=1)
    distance = Counter(abs(int(text.words[a][1:]) - int(text.words[b][1:])) for a, b in _pairs(x, y))
    assert set(distance) == {1, 2, 3}  # never farther than the window
    pairs = {d: 2 * (200 - d) for d in (1, 2, 3)}  # both directions
    for d, share in ((1, 1.0), (2, 2 / 3), (3, 1 / 3)):  # kept with probability (window - d + 1) / window
        assert distance[d] == pytest.approx(share * pairs[d], abs=4 * math.sqrt(pairs[d]) + 1e-9)
    assert x.shape[1] == 2 + 3 and x.dtype == np.int32 and y.dtype == np.int64
    assert np.bincount(y, minlength=4) == pytest.approx([len(y) / 4] * 4, abs=4 * math.sqrt(len(y)))  # uniform


def test_pairs_stay_inside_blocks_and_test_blocks_are_held_out():
    tokens = [f"w{i}" for i in range(40)]
    blocks = np.arange(40) // 10
    text, (x, y), (tx, _) = _examples(tokens, blocks, [True, False, False, False], window=1)
    assert len(text.words) == 30 and "w0" not in text.words  # the vocabulary is counted on training blocks
    block_of = {i: int(w[1:]) // 10 for i, w in enumerate(text.words)}
    assert all(block_of[a] == block_of[b] for a, b in _pairs(x, y))
    assert len(x) == 2 * 3 * 9 and len(tx) == 0  # the test block's words are out of the vocabulary: no pairs


def test_rare_words_are_dropped_before_windowing():
    tokens = "a b rare a b a b".split()
    text, (x, y), _ = _examples(tokens, vocab=2, window=1)
    assert text.words == ("a", "b")
    # "rare" is gone, so its neighbours b and a become adjacent: the stream is a b a b a b
    assert sorted(_pairs(x, y)) == sorted([(0, 1), (1, 0)] * 5)


def test_subsampling_is_seeded_and_thins_frequent_words():
    rng = np.random.default_rng(0)
    tokens = ["the" if rng.random() < 0.5 else f"w{rng.integers(40)}" for _ in range(4000)]
    a = _examples(tokens, subsample=1e-2, seed=3)
    b = _examples(tokens, subsample=1e-2, seed=3)
    c = _examples(tokens, subsample=1e-2, seed=4)
    assert np.array_equal(a[1][0], b[1][0]) and not np.array_equal(a[1][0], c[1][0])
    full = _examples(tokens, seed=3)
    the = a[0].words.index("the")
    share = (a[1][0][:, 0] == the).mean()
    assert share < 0.5 * (full[1][0][:, 0] == full[0].words.index("the")).mean()  # "the" kept ~ sqrt(0.01 / 0.5)


def test_negatives_follow_the_smoothed_unigram():
    tokens = ["a"] * 800 + ["b"] * 100 + ["c"] * 100
    text, (x, y), _ = _examples(tokens, vocab=3, window=1, negatives=20, seed=0)
    noise = np.ones(x[:, 1:].shape, dtype=bool)
    noise[np.arange(len(y)), y] = False
    drawn = np.bincount(x[:, 1:][noise], minlength=3) / noise.sum()
    p = np.array([800, 100, 100]) ** 0.75
    assert drawn == pytest.approx(p / p.sum(), abs=0.01)


@pytest.mark.parametrize("seed", range(5))
def test_spearman_matches_scipy(seed):
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 8, (60,), generator=g).double()  # many ties
    b = a + torch.randn(60, generator=g, dtype=torch.float64) * 3
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a.numpy(), b.numpy())[0], abs=1e-12)
    assert ranks(a).numpy() == pytest.approx(stats.rankdata(a.numpy()))


def test_similarity_score_counts_covered_pairs():
    e = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [-1.0, 0.1]])
    index = {"cat": 0, "kitten": 1, "car": 2, "not": 3}
    pairs = [("cat", "kitten", 9.0), ("cat", "car", 3.0), ("cat", "not", 1.0), ("cat", "unknown", 5.0)]
    assert similarity_score(e, index, pairs) == (pytest.approx(100.0), 3)
    assert math.isnan(similarity_score(e, index, pairs[:1])[0])


def test_analogy_scorer_on_a_hand_built_embedding():
    # gender along axis 0, royalty along axis 1, a distractor close to b - a + c
    words = ["man", "woman", "king", "queen", "boy", "girl", "x"]
    e = torch.tensor([[1, 0, 0.1], [-1, 0, 0.1], [1, 1, 0], [-1, 1, 0], [1, 0, 1], [-1, 0, 1], [0, 0, -1.0]])
    index = {w: i for i, w in enumerate(words)}
    questions = [("man", "woman", "king", "queen"), ("king", "queen", "boy", "girl"), ("man", "king", "boy", "x"),
                 ("man", "woman", "king", "absent")]
    assert analogy_accuracy(e, index, questions) == (pytest.approx(200 / 3), 3)
    assert analogy_accuracy(e, index, questions[3:]) == (pytest.approx(math.nan, nan_ok=True), 0)


def test_eval_files_are_found_or_named(tmp_path, monkeypatch):
    monkeypatch.setenv(embeddings.ENV, str(tmp_path))
    with pytest.raises(ValueError, match="pip install gensim") as caught:
        eval_dir()
    assert "\n" not in str(caught.value) and "wordsim353.tsv" in str(caught.value)
    (tmp_path / "wordsim353.tsv").write_text("# header\ncat\tkitten\t9.0\ncat\tcar\t2.0\n")
    (tmp_path / "simlex999.txt").write_text("cat\tkitten\t8.0\n")
    (tmp_path / "questions-words.txt").write_text(": section\nman woman king queen\n")
    sets = EmbeddingScores.load()
    assert sets.wordsim == [("cat", "kitten", 9.0), ("cat", "car", 2.0)]
    assert sets.analogies == [("man", "woman", "king", "queen")]
    assert sets.for_vocabulary(["cat", "kitten", "car"]).coverage() == {"wordsim353": 2, "simlex999": 1,
                                                                          "analogy": 0}


def _gensim_files():
    try:
        return eval_dir()
    except ValueError:
        return None


@pytest.mark.skipif(_gensim_files() is None, reason="the evaluation files ship in gensim's wheel: pip install gensim")
def test_the_real_files_parse():
    sets = EmbeddingScores.load()
    assert len(sets.wordsim) == 353 and len(sets.simlex) == 999 and len(sets.analogies) == 19544


def test_the_loss_is_the_softmax_over_the_candidates():
    model = SkipGramNegative(20, dim=8)
    torch.nn.init.normal_(model.context.weight)
    x = torch.randint(0, 20, (5, 2 + 4))
    y = torch.tensor([0, 4, 2, 1, 3])
    s = (model.context(x[:, 1:]) * model.embed(x[:, :1])).sum(-1)  # [5, 5]: the dot products
    expected = -(s[torch.arange(5), y] - s.logsumexp(1)).mean()
    assert cross_entropy(model(x), y).item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.equal(model.embeddings(), model.embed.weight)


def _toy_task(scorer=None):
    # two topics: words 0-9 co-occur with each other, words 10-19 likewise
    rng = np.random.default_rng(0)
    topic = rng.integers(0, 2, 1500)
    tokens = [f"w{10 * t + rng.integers(10)}" for t in np.repeat(topic, 8)]
    text, (x, y), (tx, ty) = _examples(tokens, np.repeat(np.arange(1500), 8), np.arange(1500) % 10 == 0,
                                       window=2, negatives=5)
    words = text.words
    data = Dataset("toy-w2v", torch.from_numpy(x[:8000]), torch.from_numpy(y[:8000]), torch.from_numpy(tx[:2000]),
                   torch.from_numpy(ty[:2000]), len(words), "skipgram-neg", scorer=scorer)
    return data, words


def test_a_tiny_run_learns_and_records_its_scores(tmp_path):
    torch.set_num_threads(1)
    calls = []

    def scorer(model):
        calls.append(1)
        return {"norm": float(model.embeddings().detach().norm())}

    data, _ = _toy_task(scorer)
    config = RunConfig(task="toy-w2v", method="adasum", workers=4, lr=0.01, epochs=2, batch_size=64,
                       optimizer="adam", evals_per_epoch=2)
    result = train(config, tmp_path, dataset=data)
    first, last = result["history"]
    # log 6 at the start (equal scores); the best is about 1.17 (the context is one of ~3.5 words of its topic)
    assert first["val_loss"] < math.log(6) - 0.3 and last["val_loss"] < 1.3
    assert last["val_accuracy"] > 28 > result["chance_accuracy"] + result["chance_noise"]
    assert "norm" in last["scores"] and result["scores"] == last["scores"]
    assert all("scores" in point for point in result["curve"]) and len(calls) >= 4
    assert not result["collapsed"]


def _fake_eval(folder):
    (folder / "wordsim353.tsv").write_text("the\tof\t5.0\nthe\tlist\t3.0\nthing\tlist\t7.0\n")
    (folder / "simlex999.txt").write_text("the\tof\t5.0\n")
    (folder / "questions-words.txt").write_text(": s\nthe of thing list\n")


def test_the_task_builds_from_a_gcide_file_and_scores_its_embeddings(tmp_path, monkeypatch):
    from adasum.experiments.data import english_word2vec, load_task
    from adasum.experiments.models import build_model
    from test_warmup_english import _fake_gcide

    _fake_gcide(tmp_path, entries=2000)
    _fake_eval(tmp_path)
    monkeypatch.setenv(embeddings.ENV, str(tmp_path))
    data = english_word2vec(tmp_path, vocab=6, max_pairs=5000, block=1000, subsample=0)  # 8 words: 2 dropped
    assert data.name == "english-word2vec" and data.default_model == "skipgram-neg" and data.classes == 6
    assert data.train_x.shape == (5000, 7) and len(data.test_x) == 500 and data.train_y.max() == 5
    model = build_model(data.default_model, data.input_shape, data.classes)
    assert data.scorer is not None and set(data.scorer(model)) == {"wordsim353", "simlex999", "analogy"}
    again = english_word2vec(tmp_path, vocab=6, max_pairs=5000, block=1000, subsample=0)
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.test_y, data.test_y)  # deterministic
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="apt-get install dict-gcide"):
        load_task("english-word2vec", tmp_path / "empty")
