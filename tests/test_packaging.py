"""The package as published: the sdist and the wheel built from it (``python -m build``, no download) pass
``twine check``; the wheel's metadata (license file, classifiers, URLs, version), the files it ships (py.typed),
absolute links in its long description, and the ImportError of every module whose optional extra is missing."""

import email
import importlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import adasum

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The folder holding the sdist and the wheel that ``python -m build --no-isolation`` makes of a copy of the
    checkout (the build writes next to the sources; the wheel is built from the sdist, so the sdist must hold
    everything the wheel needs; no isolation: the installed setuptools, nothing downloaded)."""
    pytest.importorskip("build", reason="needs the test extra: pip install '.[test]'")
    tree = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", "out", "."]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tree / "out"


@pytest.fixture(scope="module")
def wheel(built) -> zipfile.ZipFile:
    (path,) = built.glob("adasum-*.whl")
    return zipfile.ZipFile(path)


def test_the_sdist_and_the_wheel_pass_twine_check(built):
    pytest.importorskip("twine", reason="needs the test extra: pip install '.[test]'")
    files = sorted(str(p) for p in built.iterdir())
    assert [Path(f).name for f in files] == [f"adasum-{adasum.__version__}-py3-none-any.whl",
                                             f"adasum-{adasum.__version__}.tar.gz"]
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("PASSED") == 2, done.stdout + done.stderr
    import tarfile

    with tarfile.open(next(built.glob("*.tar.gz"))) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "src/adasum/py.typed", "src/adasum/__init__.py"} <= names


def metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def test_wheel_metadata(wheel):
    meta = metadata(wheel)
    assert meta["Version"] == adasum.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Topic :: ") for c in classifiers)
    assert meta["Author"] and meta["Keywords"]
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Repository", "Documentation", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    names = wheel.namelist()
    assert "adasum/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {"adasum/lightning.py", "adasum/accelerate.py", "adasum/jax/__init__.py"} <= set(names)


def test_long_description_links_are_absolute_and_exist(wheel):
    """Every link of the README (the long description) works on an index page: an anchor, or an
    absolute URL; those into the repository name a file that exists in this checkout."""
    meta = metadata(wheel)
    repository = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))["Repository"]
    links = re.findall(r"\]\(([^)\s]+)\)", meta.get_payload())
    assert links
    for link in links:
        assert link.startswith(("#", "https://")), f"relative link {link!r} breaks on an index page"
        if link.startswith(repository + "/blob/main/"):
            path = link[len(repository + "/blob/main/") :].split("#")[0]
            assert (ROOT / path).is_file(), f"{link} names no file of the repository"


@pytest.mark.parametrize(
    "module, blocked, extra",
    [("adasum.jax", "jax", "jax"), ("adasum.lightning", "lightning", "lightning"),
     ("adasum.accelerate", "accelerate", "accelerate")],
)
def test_missing_extra_names_it(module, blocked, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, blocked, None)  # import of `blocked` raises ImportError
    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, module.replace("adasum.", "adasum.integrations."), raising=False)
    message = re.escape(f"{module} needs {blocked}") + ".*" + re.escape(f": pip install 'adasum[{extra}]'")
    with pytest.raises(ImportError, match=message):
        importlib.import_module(module)


def test_tensorboard_without_its_extra_names_it(monkeypatch, tmp_path):
    """A run asked for TensorBoard logs without the extra stops before its first step, naming the extra."""
    import torch

    from adasum.experiments.data import Dataset
    from adasum.experiments.runner import RunConfig, train

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    toy = Dataset("toy", x[:32], (x[:32, 0] > 0).long(), x[32:], (x[32:, 0] > 0).long(), 2, "mlp")
    steps: list = []
    message = "--tensorboard needs the tensorboard extra: pip install 'adasum[tensorboard]'"
    with pytest.raises(ValueError, match=re.escape(message)):
        train(RunConfig(task="toy", method="adasum", workers=2, lr=0.1, epochs=1, batch_size=8), tmp_path,
              dataset=toy, tensorboard=True, on_step=lambda rank, step: steps.append(step))
    assert steps == []


def test_optional_modules_load_on_first_access():
    """``import adasum`` leaves the optional public modules out; ``adasum.<name>`` loads one (a missing extra
    raising the ImportError that names it); any other unknown name is an AttributeError."""
    code = (
        "import sys, adasum\n"
        "assert not [m for m in adasum.ON_ACCESS if f'adasum.{m}' in sys.modules], sys.modules.keys()\n"
        "assert adasum.fsdp.enable is sys.modules['adasum.fsdp'].enable\n"
        "assert callable(adasum.loggers.log_statistics)\n"
        "sys.modules['jax'] = None\n"
        "try:\n    adasum.jax\nexcept ImportError as e:\n    assert \"pip install 'adasum[jax]'\" in str(e), e\n"
        "else:\n    raise AssertionError('adasum.jax without jax')\n"
        "try:\n    adasum.nope\nexcept AttributeError as e:\n    assert \"no attribute 'nope'\" in str(e), e\n"
        "else:\n    raise AssertionError('adasum.nope')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
