"""Scores of word embeddings: word similarity (WordSim-353, SimLex-999) and the Google analogy questions.

The three files ship in gensim's wheel (``gensim/test/test_data/``: ``wordsim353.tsv``, ``simlex999.txt``,
``questions-words.txt``); nothing is downloaded. `eval_dir` finds them: the folder in ``ADASUM_WORD2VEC_EVAL``
when set, else an installed gensim's test data (found without importing gensim).

* **Similarity**: Spearman's rank correlation (ties get their mean rank) x 100 between the cosine similarity
  of the two words' embeddings and the human score, over the pairs whose words are both in the vocabulary
  (`similarity_score`).
* **Analogy** (3CosAdd, Mikolov et al. 2013): for "a is to b as c is to ?", the vocabulary word (other than
  a, b and c) of the highest cosine with ``b - a + c`` of the unit embeddings; accuracy in percent over the
  questions whose four words are in the vocabulary (`analogy_accuracy`). Words are lowercased.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

FILES = ("wordsim353.tsv", "simlex999.txt", "questions-words.txt")
ENV = "ADASUM_WORD2VEC_EVAL"

Pairs = list[tuple[str, str, float]]
Questions = list[tuple[str, str, str, str]]


def eval_dir(folder: str | os.PathLike | None = None) -> Path:
    """The folder holding the three evaluation files (`FILES`): `folder`, else ``$ADASUM_WORD2VEC_EVAL``, else an
    installed gensim's ``test/test_data``; ValueError in one line saying how to get them."""
    candidates: list[Path] = []
    chosen = folder if folder is not None else os.environ.get(ENV)
    if chosen is not None:
        candidates.append(Path(chosen).expanduser())
    else:
        spec = importlib.util.find_spec("gensim")
        if spec is not None and spec.origin is not None:
            candidates.append(Path(spec.origin).parent / "test" / "test_data")
    for path in candidates:
        if all((path / name).is_file() for name in FILES):
            return path
    where = f"{candidates[0]} lacks {', '.join(n for n in FILES if not (candidates[0] / n).is_file())}" \
        if candidates else "gensim is not installed"
    raise ValueError(
        f"the word2vec scores need {', '.join(FILES)} ({where}): `pip install gensim` ships them, "
        f"or set {ENV}=DIR to a folder holding them (nothing is downloaded)"
    )


def read_pairs(path: str | os.PathLike) -> Pairs:
    """Word pairs and their human score from a tab-separated file (``#`` lines are comments), words lowercased."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 3:
            raise ValueError(f"{path}: {line!r} is not 'word<TAB>word<TAB>score'; use the file gensim ships")
        out.append((parts[0].strip().lower(), parts[1].strip().lower(), float(parts[2])))
    return out


def read_analogies(path: str | os.PathLike) -> Questions:
    """The analogy questions ``a b c d`` of a file in the Google format (``:`` lines name sections), lowercased."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith(":"):
            continue
        words = line.lower().split()
        if len(words) != 4:
            raise ValueError(f"{path}: {line!r} is not four words; use the file gensim ships")
        out.append((words[0], words[1], words[2], words[3]))
    return out


def ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of `values` (float64), ties given their mean rank.

    >>> ranks(torch.tensor([10.0, 30.0, 20.0, 20.0])).tolist()
    [1.0, 4.0, 2.5, 2.5]
    """
    values = values.double()
    order = torch.argsort(values, stable=True)
    sorted_values = values[order]
    out = torch.empty_like(values)
    start = 0
    n = len(values)
    while start < n:
        end = start + 1
        while end < n and sorted_values[end] == sorted_values[start]:
            end += 1
        out[order[start:end]] = (start + end + 1) / 2  # mean of ranks start+1 .. end
        start = end
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two equally long vectors (Pearson's of their `ranks`); NaN when either is
    constant or shorter than 2.

    >>> round(spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 5.0, 9.0, 7.0])), 6)
    0.8
    """
    if len(a) != len(b):
        raise ValueError(f"spearman got vectors of {len(a)} and {len(b)} values; pass two of one length")
    if len(a) < 2:
        return math.nan
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    norm = float(ra.norm() * rb.norm())
    return float((ra @ rb) / norm) if norm > 0 else math.nan


def unit_rows(embedding: torch.Tensor) -> torch.Tensor:
    """The rows of `embedding` scaled to unit length (a zero row stays zero), float32 on the CPU."""
    e = embedding.detach().float().cpu()
    return e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)


def similarity_score(embedding: torch.Tensor, index: dict[str, int], pairs: Pairs) -> tuple[float, int]:
    """(Spearman x 100 between cosine similarity and human score, pairs covered) over the `pairs` whose two
    words are in `index` (word -> row of `embedding`); NaN with fewer than 2 covered."""
    covered = [(index[a], index[b], s) for a, b, s in pairs if a in index and b in index]
    if len(covered) < 2:
        return math.nan, len(covered)
    e = unit_rows(embedding)
    ia = torch.tensor([a for a, _, _ in covered])
    ib = torch.tensor([b for _, b, _ in covered])
    cosine = (e[ia] * e[ib]).sum(1)
    return 100.0 * spearman(cosine, torch.tensor([s for _, _, s in covered])), len(covered)


def analogy_accuracy(
    embedding: torch.Tensor, index: dict[str, int], questions: Questions, chunk: int = 2048
) -> tuple[float, int]:
    """(3CosAdd accuracy in percent, questions covered) over the `questions` whose four words are in `index`;
    NaN when none is covered. The answer excludes the question's three words.

    >>> e = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [-1.0, 1.0], [1.0, -1.0]])
    >>> index = {"man": 0, "king": 1, "woman": 2, "queen": 3, "other": 4}
    >>> analogy_accuracy(e, index, [("man", "king", "woman", "queen"), ("man", "absent", "woman", "queen")])
    (100.0, 1)
    """
    covered = [tuple(index[w] for w in q) for q in questions if all(w in index for w in q)]
    if not covered:
        return math.nan, 0
    e = unit_rows(embedding)
    q = torch.tensor(covered)
    correct = 0
    for start in range(0, len(q), chunk):
        part = q[start : start + chunk]
        target = e[part[:, 1]] - e[part[:, 0]] + e[part[:, 2]]
        scores = target @ e.T
        scores.scatter_(1, part[:, :3], -math.inf)
        correct += int((scores.argmax(1) == part[:, 3]).sum())
    return 100.0 * correct / len(q), len(q)


def input_embeddings(model: nn.Module) -> torch.Tensor:
    """The word vectors of a word2vec model: its ``embeddings()`` when it has one, else its ``embed`` table."""
    method = getattr(model, "embeddings", None)
    if callable(method):
        return method()
    embed = getattr(model, "embed", None)
    if isinstance(embed, nn.Embedding):
        return embed.weight
    raise ValueError(f"{type(model).__name__} has no word embeddings (an embeddings() method or an embed table); "
                     "use a word2vec model (--model skipgram-neg or skipgram)")


@dataclass(frozen=True)
class EmbeddingScores:
    """The three evaluation sets; `for_vocabulary` makes a data set's scorer."""

    wordsim: Pairs
    simlex: Pairs
    analogies: Questions

    @classmethod
    def load(cls, folder: str | os.PathLike | None = None) -> EmbeddingScores:
        """The three files from `eval_dir` (`folder`, the environment or gensim)."""
        path = eval_dir(folder)
        return cls(read_pairs(path / FILES[0]), read_pairs(path / FILES[1]), read_analogies(path / FILES[2]))

    def coverage(self, words: Sequence[str]) -> dict[str, int]:
        """How many items of each set a vocabulary covers."""
        index = set(words)
        return {
            "wordsim353": sum(a in index and b in index for a, b, _ in self.wordsim),
            "simlex999": sum(a in index and b in index for a, b, _ in self.simlex),
            "analogy": sum(all(w in index for w in q) for q in self.analogies),
        }

    def for_vocabulary(self, words: Sequence[str]) -> WordScorer:
        """A scorer of models whose embedding row i is ``words[i]``."""
        return WordScorer(self, {w: i for i, w in enumerate(words)})


@dataclass(frozen=True)
class WordScorer:
    """Called with a word2vec model: ``{"wordsim353": ..., "simlex999": ..., "analogy": ...}`` (`similarity_score`
    x 2, `analogy_accuracy`), over the items the vocabulary covers (`coverage`)."""

    sets: EmbeddingScores
    index: dict[str, int]

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        """The model's scores by name."""
        e = input_embeddings(model)
        return {
            "wordsim353": similarity_score(e, self.index, self.sets.wordsim)[0],
            "simlex999": similarity_score(e, self.index, self.sets.simlex)[0],
            "analogy": analogy_accuracy(e, self.index, self.sets.analogies)[0],
        }

    def coverage(self) -> dict[str, int]:
        """The items of each set whose words are all in the vocabulary."""
        return self.sets.coverage(list(self.index))
