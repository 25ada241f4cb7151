"""`adasum.settings`: what each variable accepts (the usual boolean spellings, numbers in their range), the
errors for anything else (naming the variable and its value), the same checks on `override`, and the warning for
an ``ADASUM_*`` variable that is not a setting."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from adasum.settings import Settings, current, override

FLAGS = {
    "ADASUM_CUDA_GRAPHS": "cuda_graphs",
    "ADASUM_SYMMETRIC": "symmetric",
    "ADASUM_SYMMETRIC_PUSH": "symmetric_push",
    "ADASUM_SYMMETRIC_CHUNKS": "symmetric_chunks",
}


@pytest.mark.parametrize("variable", FLAGS)
def test_boolean_variables_take_the_usual_spellings(variable):
    field = FLAGS[variable]
    for off in ("0", "false", "False", "NO", "off", " Off "):
        assert getattr(Settings.from_env({variable: off}), field) is False, off
    for on in ("1", "true", "TRUE", "yes", "On"):
        assert getattr(Settings.from_env({variable: on}), field) is True, on
    assert getattr(Settings.from_env({variable: ""}), field) is True  # empty: the default
    with pytest.raises(ValueError) as info:
        Settings.from_env({variable: "disabled"})
    assert str(info.value) == (
        f"adasum.settings: {variable}='disabled' is not a boolean; use 0/1, false/true, no/yes, off/on (any case)"
    )


def test_triton_vectors_take_their_values_and_the_boolean_spellings():
    read = lambda value: Settings.from_env({"ADASUM_TRITON_VECTORS": value}).triton_vectors  # noqa: E731
    assert [read(v) for v in ("1", "0", "2-byte", "off", "no", "false", "on", "2-Byte")] == [
        "1", "0", "2-byte", "0", "0", "0", "1", "2-byte"]
    with pytest.raises(ValueError) as info:
        read("4-byte")
    assert str(info.value) == (
        "adasum.settings: ADASUM_TRITON_VECTORS='4-byte' is not one of 1, 2-byte, 0 "
        "(or 0/1, false/true, no/yes, off/on (any case)); set one of them"
    )


@pytest.mark.parametrize(
    "env,message",
    [
        ({"ADASUM_MEMORY_MB": "-64"}, "memory_mb (ADASUM_MEMORY_MB) must be a finite number > 0 (MiB), got -64.0"),
        ({"ADASUM_MEMORY_MB": "0"}, "memory_mb (ADASUM_MEMORY_MB) must be a finite number > 0 (MiB), got 0.0"),
        ({"ADASUM_MEMORY_MB": "nan"}, "memory_mb (ADASUM_MEMORY_MB) must be a finite number > 0 (MiB), got nan"),
        ({"ADASUM_MEMORY_MB": "inf"}, "memory_mb (ADASUM_MEMORY_MB) must be a finite number > 0 (MiB), got inf"),
        ({"ADASUM_MEMORY_MB": "lots"}, "ADASUM_MEMORY_MB='lots' is not a number"),
        ({"ADASUM_ONE_SHOT_BYTES": "-1"}, "one_shot_bytes (ADASUM_ONE_SHOT_BYTES) must be >= 0, got -1"),
        ({"ADASUM_SYMMETRIC_MAX_CHUNKS": "0"},
         "symmetric_max_chunks (ADASUM_SYMMETRIC_MAX_CHUNKS) must be >= 1, got 0"),
        ({"ADASUM_SYMMETRIC_CHUNK_BYTES": "0"},
         "symmetric_chunk_bytes (ADASUM_SYMMETRIC_CHUNK_BYTES) must be >= 1, got 0"),
        ({"ADASUM_SYMMETRIC_CHUNK_BYTES": "1.5"}, "ADASUM_SYMMETRIC_CHUNK_BYTES='1.5' is not an integer"),
        ({"LOCAL_WORLD_SIZE": "-3"}, "local_world_size (LOCAL_WORLD_SIZE) must be >= 1, got -3"),
        ({"LOCAL_WORLD_SIZE": "0"}, "local_world_size (LOCAL_WORLD_SIZE) must be >= 1, got 0"),
        ({"LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc' is not an integer"),
        ({"LOCAL_RANK": "-2"}, "local_rank (LOCAL_RANK) must be >= 0, got -2"),
        ({"GROUP_RANK": "-5"}, "group_rank (GROUP_RANK) must be >= 0, got -5"),
    ],
)
def test_numbers_out_of_range_name_the_variable_and_value(env, message):
    with pytest.raises(ValueError) as info:
        Settings.from_env(env)
    assert str(info.value).startswith(f"adasum.settings: {message}; set "), str(info.value)


def test_numbers_in_range_and_the_documented_zeros_are_kept():
    s = Settings.from_env({"ADASUM_ONE_SHOT_BYTES": "0", "ADASUM_MEMORY_MB": "64.5", "LOCAL_WORLD_SIZE": "4",
                           "LOCAL_RANK": "0", "GROUP_RANK": "-1", "ADASUM_SYMMETRIC_MAX_CHUNKS": "1"})
    assert (s.one_shot_bytes, s.memory_mb, s.local_world_size, s.local_rank, s.group_rank, s.symmetric_max_chunks) == (
        0, 64.5, 4, 0, None, 1)  # one-shot never; a rank of -1 is the usual "not distributed", as unset
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize(
    "changes,error,message",
    [
        ({"memory_mb": -1}, ValueError, "memory_mb (ADASUM_MEMORY_MB) must be a finite number > 0 (MiB), got -1"),
        ({"memory_mb": "64"}, TypeError, "memory_mb (ADASUM_MEMORY_MB) must be a number (MiB), got '64'"),
        ({"piece_elements": (0, 0)}, ValueError, "piece_elements must be >= 1 element each, got (0, 0)"),
        ({"piece_elements": [10, 10]}, TypeError,
         "piece_elements must be a tuple of two ints (gloo, NCCL), got [10, 10]"),
        ({"one_shot_bytes": -1}, ValueError, "one_shot_bytes (ADASUM_ONE_SHOT_BYTES) must be >= 0, got -1"),
        ({"symmetric_max_chunks": 2.5}, TypeError,
         "symmetric_max_chunks (ADASUM_SYMMETRIC_MAX_CHUNKS) must be an int, got 2.5"),
        ({"local_world_size": 0}, ValueError, "local_world_size (LOCAL_WORLD_SIZE) must be >= 1, got 0"),
        ({"cuda_graphs": "no"}, TypeError, "cuda_graphs (ADASUM_CUDA_GRAPHS) must be a bool, got 'no'"),
        ({"deferred_checks": 1}, TypeError, "deferred_checks must be a bool or None, got 1"),
        ({"triton_vectors": "off"}, ValueError,
         "triton_vectors (ADASUM_TRITON_VECTORS) must be one of ['1', '2-byte', '0'], got 'off'"),
    ],
)
def test_override_is_checked_as_the_environment_is(changes, error, message):
    before = current()
    with pytest.raises(error) as info, override(**changes):
        pass
    assert str(info.value).startswith(f"adasum.settings: {message}; set "), str(info.value)
    assert current() is before  # nothing changed


def test_an_unknown_adasum_variable_warns_with_the_closest_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = Settings.from_env({"ADASUM_CUDA_GRAPH": "0", "ADASUM_CACHE": "/tmp", "ADASUM_TEST_BACKEND": "gloo",
                               "ADASUM_WORD2VEC_EVAL": "/tmp",
                               "OTHER_THING": "1", "ADASUM_ZZZ": "1"})
    assert s.cuda_graphs is True  # the typo is not read
    assert [str(w.message) for w in caught] == [
        "adasum.settings: the environment variable ADASUM_CUDA_GRAPH is not a setting of adasum and is ignored "
        "(did you mean ADASUM_CUDA_GRAPHS?); remove or rename it",
        "adasum.settings: the environment variable ADASUM_ZZZ is not a setting of adasum and is ignored "
        "(docs/settings.md lists the variables); remove or rename it",
    ]
    assert all(w.category is UserWarning for w in caught)


def test_the_process_reads_its_environment_once_and_warns_once():
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from adasum.settings import current\n"
        "print(current().cuda_graphs, current().symmetric, current() is current())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "ADASUM_CUDA_GRAPHS": "off", "ADASUM_SYMMETRC": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "True"]
    assert proc.stderr.count("ADASUM_SYMMETRC is not a setting") == 1, proc.stderr
    assert "did you mean ADASUM_SYMMETRIC?" in proc.stderr


def test_the_transport_put_first_must_be_a_transport_name():
    """``ADASUM_TEST_TRANSPORT`` takes the names ``transport=`` takes (empty: unset), from the environment and from
    `override` alike: a typo is refused where the settings are read, not only where an NCCL group reads it (gloo
    never does)."""
    from adasum.options import TransportName, choices
    from adasum.settings import TRANSPORT_NAMES

    assert TRANSPORT_NAMES == choices(TransportName)
    for name in (*TRANSPORT_NAMES, ""):
        assert Settings.from_env({"ADASUM_TEST_TRANSPORT": name}).transport_first == name
    names = "['p2p', 'collectives', 'symmetric', 'slices', 'one-shot']"
    with pytest.raises(ValueError) as info:
        Settings.from_env({"ADASUM_TEST_TRANSPORT": "p2pp"})
    assert str(info.value) == (
        f"adasum.settings: transport_first (ADASUM_TEST_TRANSPORT) must be one of {names} or empty, got 'p2pp'; set "
        "one of them"
    )
    with pytest.raises(ValueError) as info, override(transport_first="nccl"):
        pass
    assert str(info.value) == (
        f"adasum.settings: transport_first (ADASUM_TEST_TRANSPORT) must be one of {names} or empty, got 'nccl'; set "
        "one of them"
    )


@pytest.mark.parametrize(
    "name,hint",
    [
        ("cuda_graph", "did you mean cuda_graphs?"),
        ("ADASUM_MEMORY_MB", "did you mean memory_mb, the field of that variable?"),
        ("shaping", "the fields of adasum.settings.Settings are the settings"),
    ],
)
def test_override_names_an_unknown_setting_and_the_closest_field(name, hint):
    before = current()
    with pytest.raises(TypeError) as info, override(**{name: 1}):
        pass
    assert str(info.value) == (f"adasum.settings: override got {name!r}, which is not a setting ({hint}); pass a field "
                               "of Settings")
    assert current() is before
