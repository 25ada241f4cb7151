"""The learning-rate warm-up of the experiment runner, and the English-prose task read from GCIDE's file."""

from __future__ import annotations

import gzip

import pytest
import torch

from adasum.experiments.data import english_corpus, gcide_text, load_task
from adasum.experiments.runner import RunConfig, make_optimizer


def _lrs(optimizer: torch.optim.Optimizer, steps: int, param: torch.Tensor) -> list[float]:
    seen = []
    for _ in range(steps):
        param.grad = torch.ones_like(param)
        optimizer.step()
        seen.append(optimizer.param_groups[0]["lr"])
    return seen


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_warmup_is_linear_then_flat_and_survives_a_restore(name):
    param = torch.zeros(3, requires_grad=True)
    factory = make_optimizer(RunConfig(optimizer=name), lr=0.4, warmup_steps=4)
    optimizer = factory([param])
    assert _lrs(optimizer, 2, param) == pytest.approx([0.1, 0.2])
    state = optimizer.state_dict()
    again = factory([param])  # a restart: a new optimizer, the saved state loaded
    again.load_state_dict(state)
    assert _lrs(again, 4, param) == pytest.approx([0.3, 0.4, 0.4, 0.4])


def test_no_warmup_leaves_the_optimizer_alone():
    param = torch.zeros(2, requires_grad=True)
    optimizer = make_optimizer(RunConfig(), lr=0.5)([param])
    assert _lrs(optimizer, 3, param) == [0.5, 0.5, 0.5]
    assert "warmup_step" not in optimizer.param_groups[0]


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ValueError, match="warm-up epochs must be in"):
        RunConfig(epochs=2, warmup_epochs=3).validate()


def _fake_gcide(folder, entries=3000):
    header = "00-database-info\n   This is the header.\n"
    body = "".join(
        f'Word{i} \\Word"{i}\\, n. [L. word{i}.]\n   1. The {i}th {{thing}} of the list.\n      [1913 Webster]\n\n'
        for i in range(entries)
    )
    with gzip.open(folder / "gcide.dict.dz", "wb") as f:
        f.write((header + body).encode())


def test_gcide_text_strips_markup(tmp_path):
    _fake_gcide(tmp_path)
    text = gcide_text(tmp_path).decode()
    lines = text.split("\n")
    assert lines[0] == "Word0 , n. [L. word0.] 1. The 0th thing of the list."
    assert len(lines) == 3000 and "Webster" not in text and "00-database" not in text and "{" not in text


def test_english_corpus_windows_and_held_out_blocks(tmp_path):
    _fake_gcide(tmp_path, entries=6000)
    data = english_corpus(tmp_path, context=16, max_bytes=100_000, block=4096)
    assert data.train_x.shape[1] == 16 and data.classes == 128
    assert torch.equal(data.train_x[:, 1:], data.train_y[:, :-1])  # targets are the next bytes
    raw = gcide_text(tmp_path)
    test_block = bytes(data.test_x[0].tolist())
    assert test_block == raw[:16]  # block 0 is held out for test
    assert all(bytes(row.tolist()) != raw[:16] for row in data.train_x[:64])


def test_english_names_the_package_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dict-gcide"):
        load_task("english", tmp_path)
