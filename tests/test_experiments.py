"""The experiment harness: data readers on tiny files, models, methods, the run loop."""

from __future__ import annotations

import gzip
import logging
import pickle
import socket
import struct

import numpy as np
import pytest
import torch

from adasum.experiments import data as data_mod
from adasum.experiments.data import load_task, read_cifar10_dir, read_idx, read_mnist_dir, skipgram_pairs, text_corpus
from adasum.experiments.methods import METHODS, get_method, method_reducer, parse_methods
from adasum.experiments.models import MODELS, build_model
from adasum.experiments.runner import RunConfig, train, worker_batches
from adasum.reducers import AdaCons, Adasum, Mean, Sum
from adasum.reducers.base import reducer_names


@pytest.fixture(scope="module")
def digits():
    return load_task("digits")


def write_idx(path, array: np.ndarray, compress: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def test_read_idx_plain_and_gzip(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a-idx3-ubyte", a)
    write_idx(tmp_path / "b-idx3-ubyte.gz", a, compress=True)
    np.testing.assert_array_equal(read_idx(tmp_path / "a-idx3-ubyte"), a)
    np.testing.assert_array_equal(read_idx(tmp_path / "b-idx3-ubyte.gz"), a)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="header says"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("name,sub", [("mnist", "."), ("mnist", "MNIST/raw"), ("fashion-mnist", "FashionMNIST/raw")])
def test_mnist_directory_layouts(tmp_path, name, sub):
    folder = tmp_path / sub
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    train_x, test_x = rng.integers(0, 256, (6, 28, 28)), rng.integers(0, 256, (3, 28, 28))
    train_y, test_y = np.array([0, 1, 2, 3, 4, 9]), np.array([5, 6, 7])
    write_idx(folder / "train-images-idx3-ubyte", train_x)
    write_idx(folder / "train-labels-idx1-ubyte.gz", train_y, compress=True)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", test_x, compress=True)
    write_idx(folder / "t10k-labels-idx1-ubyte", test_y)
    data = load_task(name, tmp_path)
    assert data.train_x.shape == (6, 1, 28, 28) and data.test_x.shape == (3, 1, 28, 28)
    assert data.train_y.tolist() == train_y.tolist() and data.test_y.tolist() == test_y.tolist()
    mean, std = (0.2860, 0.3530) if name == "fashion-mnist" else (0.1307, 0.3081)
    expected = (torch.tensor(train_x[2], dtype=torch.float32) / 255 - mean) / std
    torch.testing.assert_close(data.train_x[2, 0], expected)
    assert read_mnist_dir(tmp_path, name).name == name


def test_cifar10_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name, n in [("data_batch_1", 4), ("data_batch_2", 3), ("test_batch", 2)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8), b"labels": list(range(n))}
        batches[name] = batch
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2 if name == "test_batch" else 5))
    data = read_cifar10_dir(tmp_path)  # protocol 2 as the real files, 5 as a re-pickled copy
    assert data.train_x.shape == (7, 3, 32, 32) and data.test_x.shape == (2, 3, 32, 32)
    assert data.train_y.tolist() == [0, 1, 2, 3, 0, 1, 2]
    red = batches["data_batch_2"][b"data"][1, :1024].reshape(32, 32)
    torch.testing.assert_close(data.train_x[5, 0], (torch.tensor(red, dtype=torch.float32) / 255 - 0.4914) / 0.2470)


class _Payload:
    """Unpickling this runs its payload: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.mark.parametrize("where", ["data_batch_1", "test_batch"])
def test_a_crafted_cifar10_pickle_is_refused_and_its_payload_does_not_run(tmp_path, where):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "payload-ran"
    good = {b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0, 1]}
    for name in ("data_batch_1", "test_batch"):
        batch = {**good, b"extra": _Payload(marker)} if name == where else good
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    refused = f"{where}: not a CIFAR-10 python batch .*refused global (__builtin__|builtins).exec"
    with pytest.raises(ValueError, match=refused):
        read_cifar10_dir(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "batch,message",
    [
        ({b"data": np.zeros((2, 3072), dtype=np.float32), b"labels": [0, 1]}, "uint8"),
        ({b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0]}, "list of 2 ints"),
        ([1, 2, 3], "uint8"),
    ],
)
def test_a_pickle_that_is_not_a_cifar10_batch_is_refused(tmp_path, batch, message):
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(ValueError, match=message):
        read_cifar10_dir(tmp_path)


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--data-dir"):
        load_task("mnist")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_task("cifar10", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="train-images"):
        load_task("mnist", tmp_path)
    with pytest.raises(FileNotFoundError, match="CIFAR-10"):
        load_task("cifar10", tmp_path)
    with pytest.raises(ValueError, match="unknown task"):
        load_task("imagenet")


def test_embedded_digits(digits):
    data = digits
    assert data.train_x.shape == (4000, 1, 28, 28) and data.test_x.shape == (1000, 1, 28, 28)
    assert sorted(set(data.train_y.tolist())) == list(range(10))
    assert abs(data.train_x.mean().item()) < 0.2  # normalised like Horovod's example


def test_mnist1d_is_generated_locally(tmp_path, monkeypatch, caplog):
    def no_network(*args, **kwargs):
        raise AssertionError("MNIST-1D tried to use the network")

    monkeypatch.setattr(socket, "socket", no_network)
    with caplog.at_level(logging.INFO, logger="adasum"):
        data = data_mod.load_mnist1d(tmp_path, samples=700)
        generated = [r.getMessage() for r in caplog.records]
        caplog.clear()
        again = data_mod.load_mnist1d(tmp_path, samples=700)  # from the cache
    assert len(generated) == 1 and generated[0].startswith("generating MNIST-1D")  # not a minute of silence
    assert caplog.records == []
    assert data.train_x.shape == (600, 1, 40) and data.test_x.shape == (100, 1, 40)
    assert (tmp_path / "mnist1d-700-seed42.npz").exists()
    assert torch.equal(data.train_x, again.train_x)


def test_each_task_trains_its_listed_default_model(digits):
    assert digits.default_model == data_mod.DEFAULT_MODELS["digits"] == "cnn"
    assert set(data_mod.DEFAULT_MODELS) == set(data_mod.TASKS)


def test_text_and_word2vec_corpora():
    text = text_corpus(context=32, max_bytes=200_000)
    assert text.train_x.shape[1] == 32 and text.classes == 256
    assert torch.equal(text.train_x[0, 1:], text.train_y[0, :-1])  # next-byte targets
    words = skipgram_pairs(vocab=300, max_pairs=5000, max_bytes=200_000)
    assert words.train_x.shape == (5000,) and int(words.train_x.max()) < 300


@pytest.mark.parametrize(
    "name,shape,classes,x",
    [
        ("cnn", (1, 28, 28), 10, torch.randn(3, 1, 28, 28)),
        ("cnn", (1, 40), 10, torch.randn(3, 1, 40)),
        ("mlp", (1, 8, 8), 10, torch.randn(3, 1, 8, 8)),
        ("resnet", (3, 32, 32), 10, torch.randn(3, 3, 32, 32)),
        ("transformer", (16,), 256, torch.randint(0, 256, (3, 16))),
        ("skipgram", (), 50, torch.randint(0, 50, (3,))),
        ("skipgram-neg", (7,), 50, torch.randint(0, 50, (3, 7))),
    ],
)
def test_model_forward_shapes(name, shape, classes, x):
    out = build_model(name, shape, classes)(x)
    expected = (3, 16, 256) if name == "transformer" else (3, 6) if name == "skipgram-neg" else (3, classes)
    assert out.shape == expected


def test_every_model_is_listed_and_unknown_ones_refused():
    assert set(MODELS) == {"cnn", "mlp", "resnet", "transformer", "skipgram", "skipgram-neg"}
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg", (1, 28, 28), 10)


TABLE = {  # adasum.experiments.methods' table: reducer, combines, local steps, slow momentum, lr x P
    "sequential": ("mean", "gradient", False, False, False),
    "mean-scaled": ("mean", "gradient", False, False, True),
    "mean": ("mean", "gradient", False, False, False),
    "sum": ("sum", "gradient", False, False, False),
    "adasum": ("adasum", "gradient", False, False, False),
    "adasum-delta": ("adasum", "delta", False, False, False),
    "adacons": ("adacons", "gradient", False, False, True),
    "localsgd": ("mean", "delta", True, False, False),
    "adasum-localsgd": ("adasum", "delta", True, False, False),
    "slowmo": ("mean", "delta", True, True, False),
    "diloco": ("mean", "delta", True, False, False),
    "adasum-diloco": ("adasum", "delta", True, False, False),
    "adacons-diloco": ("adacons", "delta", True, False, False),
    "streaming-diloco": ("mean", "delta", True, False, False),
}
REDUCERS = {  # each reducer name as the table means it: the class with its default options
    "mean": (Mean, "Mean()"),
    "sum": (Sum, "Sum()"),
    "adasum": (Adasum, "Adasum(per_tensor=True)"),
    "adacons": (AdaCons, "AdaCons(momentum=0.0, per_tensor=False, scale='mean_norm')"),
}


def test_methods_table():
    """Every method is the row of the module's table, and `method_reducer` gives a fresh reducer of the class the
    row names, with its default options."""
    assert get_method("mean-scaled").learning_rate(0.01, 16) == pytest.approx(0.16)
    assert get_method("adasum").learning_rate(0.01, 16) == 0.01
    assert get_method("sequential").workers(16) == 1
    assert [m.name for m in parse_methods("mean, adasum,mean")] == ["mean", "adasum"]
    with pytest.raises(ValueError, match="unknown method 'median'"):
        parse_methods("mean,median")
    assert list(METHODS) == list(TABLE)
    for m in METHODS.values():
        assert (m.reducer, m.combine, m.local, m.slow_momentum, m.linear_lr_scaling) == TABLE[m.name], m.name
        assert m.outer == m.name.endswith("diloco") and m.streaming == m.name.startswith("streaming"), m.name
        cls, text = REDUCERS[m.reducer]
        reducer = method_reducer(m)
        assert type(reducer) is cls and reducer.name == m.reducer and repr(reducer) == text, (m.name, reducer)
        if cls is Adasum:
            assert reducer.hierarchical is False and reducer.local_size is None
        assert method_reducer(m) is not reducer  # no state (AdaCons' momentum) shared between runs


def test_adacons_missing_is_a_clear_error(monkeypatch):
    import importlib

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.delitem(reducer_names(), "adacons", raising=False)
    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ValueError, match="'adacons' reducer"):
        method_reducer(get_method("adacons"))


def test_worker_batches_partition_each_epoch():
    batches = worker_batches(103, 4, 5, epoch=2, seed=1)
    assert batches.shape == (5, 4, 5)
    flat = batches.flatten().tolist()
    assert len(set(flat)) == len(flat) and max(flat) < 103
    assert torch.equal(batches, worker_batches(103, 4, 5, epoch=2, seed=1))
    assert not torch.equal(batches, worker_batches(103, 4, 5, epoch=3, seed=1))


@pytest.mark.parametrize(
    "method,optimizer",
    [("adasum-delta", "adam"), ("slowmo", "sgd"), ("adasum-localsgd", "sgd"), ("adasum", "lamb"), ("sum", "sgd")],
)
def test_train_runs_every_placement(digits, method, optimizer):
    config = RunConfig(
        method=method, workers=4, lr=0.01, epochs=1, batch_size=8, optimizer=optimizer, train_limit=128, local_steps=2
    )
    result = train(config, dataset=digits)
    assert result["method"] == method and result["workers"] == 4 and result["steps"] == 4
    assert len(result["history"]) == 1 and result["history"][0]["orthogonality"] is not None
    assert 0 <= result["test_accuracy"] <= 100


def test_lamb_over_per_worker_copies_is_refused(digits):
    config = RunConfig(method="adasum-delta", workers=2, optimizer="lamb", train_limit=64, batch_size=8, epochs=1)
    with pytest.raises(ValueError, match="not elementwise"):
        train(config, dataset=digits)


def test_divergence_is_recorded_and_stops_the_run(digits):
    config = RunConfig(method="sum", workers=8, lr=1e6, epochs=3, batch_size=8, train_limit=256, momentum=0.0)
    result = train(config, dataset=digits)
    assert result["diverged"] and result["epochs_run"] < 3


def test_a_train_limit_above_the_training_examples_is_refused():
    from adasum.experiments.data import Dataset

    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    toy = Dataset("toy", x[:160], (x[:160, 0] > 0).long(), x[160:], (x[160:, 0] > 0).long(), 2, "mlp")
    config = RunConfig(task="toy", method="sequential", epochs=1, batch_size=8, train_limit=145)  # 160 - 16 held out
    with pytest.raises(ValueError) as error:
        train(config, dataset=toy)
    assert str(error.value) == (
        "train limit 145 is more than the 144 training examples of toy (after the validation split of 16); "
        "leave it out to train on all of them"
    )
    config.train_limit = 144
    assert train(config, dataset=toy)["steps"] == 18


def test_a_dataset_of_another_task_than_the_configs_is_refused():
    from adasum.experiments.data import Dataset

    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    toy = Dataset("toy", x[:160], (x[:160, 0] > 0).long(), x[160:], (x[160:, 0] > 0).long(), 2, "mlp")
    with pytest.raises(ValueError) as error:  # the config's task (digits, the default) would name the toy run
        train(RunConfig(method="sequential", epochs=1, batch_size=8), dataset=toy)
    assert str(error.value) == (
        "the dataset given is 'toy', the config's task 'digits'; set the task to the dataset's name "
        "(the results and checkpoints name the run by its task)"
    )


def _mnist_folder(folder, damage: str) -> str:
    """Four idx files, one damaged as `damage` says; the name of the damaged file."""
    train_x, test_x = np.zeros((6, 28, 28)), np.zeros((3, 28, 28))
    train_y, test_y = np.array([0, 1, 2, 3, 4, 9]), np.array([5, 6, 7])
    if damage == "5 x 5 images":
        train_x = np.zeros((6, 5, 5))
    if damage == "labels out of range":
        train_y = np.array([0, 1, 2, 3, 4, 10])
    if damage == "a label short":
        train_y = train_y[:5]
    write_idx(folder / "train-images-idx3-ubyte.gz", train_x, compress=True)
    write_idx(folder / "train-labels-idx1-ubyte", train_y)
    write_idx(folder / "t10k-images-idx3-ubyte", test_x)
    write_idx(folder / "t10k-labels-idx1-ubyte", test_y)
    if damage == "a truncated .gz":
        path = folder / "train-images-idx3-ubyte.gz"
        path.write_bytes(path.read_bytes()[:-20])
    return "train-images-idx3-ubyte.gz" if "images" in damage or ".gz" in damage else "train-labels-idx1-ubyte"


@pytest.mark.parametrize("damage, named", [
    ("a truncated .gz", "not a complete gzip file"),
    ("5 x 5 images", "holds uint8 [6, 5, 5], not 28 x 28 images of bytes [N, 28, 28]"),
    ("labels out of range", "labels run from 0 to 10, not within 0-9"),
    ("a label short", "holds 5 labels for 6 images"),
])
def test_damaged_mnist_files_are_one_line_naming_the_file(tmp_path, capsys, damage, named):
    from adasum.experiments.cli import main

    name = _mnist_folder(tmp_path, damage)
    status = main(["train", "--task", "mnist", "--data-dir", str(tmp_path), "--method", "adasum", "--simulate", "2",
                   "--epochs", "1", "--out", str(tmp_path / "out"), "--no-progress", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"adasum: error: {tmp_path / name}: ") and named in err[0], err


def test_an_mnist1d_cache_of_the_wrong_shape_is_one_line(tmp_path):
    path = tmp_path / "mnist1d-700-seed42.npz"
    np.savez(path, x=np.zeros((600, 40)), y=np.zeros(599, np.int64), x_test=np.zeros((100, 40)),
             y_test=np.zeros(100, np.int64))
    with pytest.raises(ValueError, match=r"mnist1d-700-seed42.npz: not an MNIST-1D cache \(x \[600, 40\], y \[599\]"):
        data_mod.load_mnist1d(tmp_path, samples=700)
    path.write_bytes(b"PK\x03\x04 damaged")
    with pytest.raises(ValueError, match=r"mnist1d-700-seed42.npz: not a complete MNIST-1D cache"):
        data_mod.load_mnist1d(tmp_path, samples=700)
