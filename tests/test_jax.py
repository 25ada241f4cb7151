"""adasum.jax on 1 to 8 fake CPU devices, against the independent NumPy references.

XLA reads the number of fake CPU devices once per process, when JAX's backend starts, and other
test modules may start it first. So under a plain ``pytest`` this module runs itself in a fresh
interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (one subprocess for the
whole file, which compiles each shape once); `test_jax_suite` reports that run. The checks that
set their own devices (import isolation, the benchmark's dry run, the example) run here directly.

Error bounds: `reference.tree_with_bound` (its module doc); float32 arithmetic unless a test says otherwise.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKER = os.environ.get("ADASUM_JAX_TESTS") == "worker"
DEVICES = 8
COUNTS = (1, 2, 3, 4, 5, 8)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def test_import_adasum_does_not_import_jax() -> None:
    code = "import sys, adasum; assert 'jax' not in sys.modules, 'import adasum imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=120)


def test_benchmark_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "jax.jsonl"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_jax.py"), "--dry-run", "--out", str(out)],
                   check=True, env=_env(), timeout=240)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["layout"] for r in rows} == {"flat-2^12", "small-resnet"}
    for r in rows:
        assert r["dry_run"] and r["devices"] == 2 and r["adasum_s"] > 0 and r["psum_s"] > 0
        assert r["ratio"] == r["adasum_s"] / r["psum_s"] and r["max_abs_err_vs_reference"] < 1e-4


def test_jax_digits_example_runs(tmp_path: Path) -> None:
    """Two Adasum steps of examples/jax_digits.py on 8 fake devices (the full run is in docs/integrations.md)."""
    out = tmp_path / "digits.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "jax_digits.py"), "--methods", "adasum", "--epochs", "1",
                    "--train-limit", "512", "--out", str(out)], check=True, env=_env(), timeout=240)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["method"] == "adasum" and row["devices"] == 8 and row["steps_per_epoch"] == 2
    assert math.isfinite(row["history"][0]["loss"]) and 0 <= row["test_accuracy"] <= 100


if not WORKER:

    def test_jax_suite() -> None:
        """Runs the checks below in a fresh interpreter with 8 fake CPU devices."""
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
             "-k", "not test_import_adasum and not test_benchmark_dry_run and not test_jax_digits_example"],
            env=_env(ADASUM_JAX_TESTS="worker"), capture_output=True, text=True, timeout=280, cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        print(proc.stdout.strip().splitlines()[-1])

else:
    from functools import lru_cache

    import jax
    import jax.numpy as jnp
    import optax
    import pytest
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import adasum.jax as aj

    from reference import U32, U64, UBF16, gamma, tree, tree_with_bound
    from reference_adacons import AdaConsReference

    SHAPES = [(3, 5), (7,), (2, 2, 2), (64,)]

    def mesh(p: int) -> Mesh:
        return Mesh(np.array(jax.devices()[:p]), ("data",))

    @lru_cache(maxsize=None)
    def mapped_all_reduce(p: int, **kwargs):
        """all_reduce over `p` devices: each leaf has a leading device axis, out the same."""

        def body(*leaves):
            return [x[None] for x in aj.all_reduce([x[0] for x in leaves], "data", **kwargs)]

        return jax.jit(jax.shard_map(body, mesh=mesh(p), in_specs=P("data"), out_specs=P("data")))

    def run(p: int, per_device: list[np.ndarray], **kwargs) -> list[np.ndarray]:
        """Per-leaf results of every device, checking they agree bitwise; returns device 0's."""
        out = [np.asarray(o) for o in mapped_all_reduce(p, **kwargs)(*per_device)]
        for o in out:
            for w in range(1, p):
                np.testing.assert_array_equal(o[w], o[0], err_msg=f"device {w} differs from device 0")
        return [o[0] for o in out]

    def random_leaves(p: int, seed: int, dtypes=None) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        dtypes = dtypes or [np.float32] * len(SHAPES)
        return [rng.standard_normal((p, *s)).astype(d) for s, d in zip(SHAPES, dtypes)]

    def check_against_reference(p, per_device, out, u, store_u):
        for x, o in zip(per_device, out):
            ref, bound = tree_with_bound([x[w].reshape(-1) for w in range(p)], u, store_u)
            err = np.linalg.norm(o.astype(np.float64).reshape(-1) - ref)
            assert err <= bound, f"P={p} leaf {x.shape[1:]}: |error| {err:.3g} > bound {bound:.3g}"

    @pytest.mark.parametrize("p", COUNTS)
    def test_matches_reference_float32(p: int) -> None:
        leaves = random_leaves(p, seed=p)
        check_against_reference(p, leaves, run(p, leaves), U32, U32)

    @pytest.mark.parametrize("p", COUNTS)
    def test_parallel_gives_mean_orthogonal_gives_sum(p: int) -> None:
        rng = np.random.default_rng(100 + p)
        scales = rng.uniform(-2, 2, size=p).astype(np.float32)  # both signs
        base = random_leaves(1, seed=200 + p)
        parallel = [(scales.reshape(-1, *[1] * (b.ndim - 1)) * b).astype(np.float32) for b in base]
        for x, o in zip(parallel, run(p, parallel)):
            mean = x.astype(np.float64).mean(0)
            _, bound = tree_with_bound([x[w].reshape(-1) for w in range(p)], U32, U32)
            assert np.linalg.norm(o.astype(np.float64) - mean) <= bound
        # disjoint supports: every dot product is exactly 0, so the result is exactly the sum
        orthogonal = []
        for x in random_leaves(p, seed=300 + p):
            owner = np.arange(x[0].size).reshape(x.shape[1:]) % p
            orthogonal.append(np.where(owner[None] == np.arange(p).reshape(-1, *[1] * (x.ndim - 1)), x, 0))
        for x, o in zip(orthogonal, run(p, orthogonal)):
            np.testing.assert_array_equal(o, x.sum(0))

    @pytest.mark.parametrize("p", (5, 8))
    def test_float64_with_x64(p: int) -> None:
        with jax.enable_x64(True):
            leaves = [x.astype(np.float64) for x in random_leaves(p, seed=400 + p)]
            out = run(p, leaves)
            assert all(o.dtype == np.float64 for o in out)
            check_against_reference(p, leaves, out, U64, U64)
            # float32 leaves accumulate in float64 too: the dot-product term of the bound uses U64
            leaves32 = random_leaves(p, seed=450 + p)
            out32 = run(p, leaves32)
            for x, o in zip(leaves32, out32):
                ref, bound = tree_with_bound([x[w].reshape(-1) for w in range(p)], U32, U32)
                assert np.linalg.norm(o.astype(np.float64).reshape(-1) - ref) <= bound

    @pytest.mark.parametrize("p", (3, 8))
    def test_bfloat16_leaves_beside_float32(p: int) -> None:
        bf16 = jnp.bfloat16
        leaves = random_leaves(p, seed=500 + p, dtypes=[bf16, np.float32, bf16, np.float32])
        out = run(p, leaves)
        assert [o.dtype for o in out] == [x.dtype for x in leaves]
        for x, o in zip(leaves, out):
            store = UBF16 if x.dtype == bf16 else U32
            ref, bound = tree_with_bound([x[w].astype(np.float64).reshape(-1) for w in range(p)], U32, store)
            assert np.linalg.norm(o.astype(np.float64).reshape(-1) - ref) <= bound

    @pytest.mark.parametrize("p", (3, 8))
    def test_pieces(p: int) -> None:
        """Buffers cut into pieces (leaves split across pieces, two dtypes) give the same tree."""
        leaves = random_leaves(p, seed=550 + p, dtypes=[np.float32, np.float32, jnp.bfloat16, np.float32])
        out = run(p, leaves, pieces=3)
        for x, o in zip(leaves, out):
            store = UBF16 if x.dtype == jnp.bfloat16 else U32
            ref, bound = tree_with_bound([x[w].astype(np.float64).reshape(-1) for w in range(p)], U32, store)
            assert np.linalg.norm(o.astype(np.float64).reshape(-1) - ref) <= bound

    def test_whole_tree_coefficients() -> None:
        p = 4
        leaves = random_leaves(p, seed=600)
        out = run(p, leaves, per_leaf=False)
        sizes = [int(np.prod(s)) for s in SHAPES]
        flat = np.concatenate([x.reshape(p, -1) for x in leaves], axis=1)
        ref, bound = tree_with_bound([flat[w] for w in range(p)], U32, U32)
        got = np.concatenate([o.reshape(-1) for o in out])
        assert np.linalg.norm(got - ref) <= bound
        assert got.size == sum(sizes)

    @pytest.mark.parametrize("p", (2, 5))
    def test_zero_vectors_never_nan(p: int) -> None:
        leaves = random_leaves(p, seed=700 + p)
        leaves[0][:] = 0  # zero on every device: the result is 0
        leaves[1][1:] = 0  # only device 0 nonzero: adasum(b, 0) = b at every level
        out = run(p, leaves)
        np.testing.assert_array_equal(out[0], 0)
        np.testing.assert_array_equal(out[1], leaves[1][0])
        assert all(np.isfinite(o).all() for o in out)

    def jnp_pair(a, b, na: int = 1, nb: int = 1):
        """`reference.pair` written again in jnp from the paper's formula, so that `jax.grad` can differentiate it."""
        dot, aa, bb = a @ b, a @ a, b @ b
        tiny = math.sqrt(np.finfo(np.float64).tiny)
        ca = jnp.where(aa < tiny, 1.0, 1.0 - na / (na + nb) * dot / jnp.where(aa < tiny, 1.0, aa))
        cb = jnp.where(bb < tiny, 1.0, 1.0 - nb / (na + nb) * dot / jnp.where(bb < tiny, 1.0, bb))
        return ca * a + cb * b

    def reference_order(items: list, node):
        """`items` combined by `node(x, y)` in `reference.tree`'s order: pairs (2i, 2i+1) for i < r folded
        first, then the binary tree over the 2**k groups."""
        p = len(items)
        q = 1 << (p.bit_length() - 1)
        r = p - q
        groups = [node(items[2 * i], items[2 * i + 1]) for i in range(r)] + items[2 * r:]

        def combine(lo: int, hi: int):
            if hi - lo == 1:
                return groups[lo]
            mid = (lo + hi) // 2
            return node(combine(lo, mid), combine(mid, hi))

        return combine(0, q)

    def jnp_tree(vectors: list):
        """`reference.tree` in jnp (counts carried)."""
        return reference_order([(v, 1) for v in vectors],
                               lambda x, y: (jnp_pair(x[0], y[0], x[1], y[1]), x[1] + y[1]))[0]

    def gradient_bound(vectors: list[np.ndarray], u: float) -> list[float]:
        """First-order bound, per input, on the 2-norm error of ``grad_v sum(tree(v)**2)`` computed by reverse mode
        through the tree in arithmetic of unit roundoff `u` (results stored in that precision too).

        Forward: each node's output error as in `reference.tree_with_bound` (its module doc). Backward, at a node
        with inputs a, b (norms A, B, weights w_a, w_b, forward errors e_a, e_b) and output cotangent g (norm G,
        error e_g): reverse mode computes ``g_a = c_a g + gdot b + 2 gaa a`` with ``gdot = -(w_a <a,g>/A^2 +
        w_b <b,g>/B^2)`` and ``gaa = w_a <a,b><a,g>/A^4``, three terms of norms at most ``(1 + w_a B/A) G``,
        ``(w_a B/A + w_b) G`` and ``2 w_a G B/A``, whose sum ``L_a G = (1 + w_b + 4 w_a B/A) G`` also bounds the
        map g -> g_a. So the error of g_a is at most ``L_a e_g`` (carried) plus its own rounding: c_a off by
        ``w_a (2 g_n + 3u) B/A`` (forward), ``u`` for the product; the dot products ``g_n`` and a few ``u`` per
        scalar operation (``(2 g_n + 4u)`` on the second term, ``(4 g_n + 5u)`` on the third); ``g_2 L_a G`` for
        adding the three; plus the forward errors of a and b through the second derivatives:
        ``|d g_a/d a| <= 20 w_a G B/A^2`` and ``|d g_a/d b| <= 4 (w_a/A + w_b/B) G`` (differentiate the three
        terms). At the root g = 2 tree(v), off by twice the forward bound. Symmetrically for b."""
        n = vectors[0].size
        gn, g2 = gamma(n, u), gamma(2, u)

        def forward(x, y):
            (va, na, ea, _), (vb, nb, eb, _) = x, y
            big_a, big_b = np.linalg.norm(va), np.linalg.norm(vb)
            wa, wb = na / (na + nb), nb / (na + nb)
            out = np.asarray(jnp_pair(jnp.asarray(va), jnp.asarray(vb), na, nb))
            local = ((2 * gn + 3 * u) * (wa * big_b + wb * big_a) + g2 * (big_a + big_b + wa * big_b + wb * big_a)
                     + u * np.linalg.norm(out))
            carried = ea * (1 + wb + 4 * wa * big_b / big_a) + eb * (1 + wa + 4 * wb * big_a / big_b)
            return out, na + nb, carried + local, (x, y)

        bounds = [0.0] * len(vectors)
        leaves = [(v.astype(np.float64), 1, 0.0, w) for w, v in enumerate(vectors)]
        root = reference_order(leaves, forward)

        def backward(node, g, eg):
            children = node[3]
            if not isinstance(children, tuple):  # a leaf: children is its index
                bounds[children] = eg
                return
            (va, na, ea, _), (vb, nb, eb, _) = children
            big_g = np.linalg.norm(g)
            _, vjp = jax.vjp(lambda a, b: jnp_pair(a, b, na, nb), jnp.asarray(va), jnp.asarray(vb))
            grads = [np.asarray(x) for x in vjp(jnp.asarray(g))]
            sides = ((va, na, ea), (vb, nb, eb))
            for i, (mine, other) in enumerate((sides, sides[::-1])):
                big_m, big_o = np.linalg.norm(mine[0]), np.linalg.norm(other[0])
                wm, wo = mine[1] / (na + nb), other[1] / (na + nb)
                ratio = big_o / big_m
                lip = 1 + wo + 4 * wm * ratio
                local = big_g * (wm * (2 * gn + 3 * u) * ratio + u * (1 + wm * ratio)
                                 + (wm * ratio + wo) * (2 * gn + 4 * u) + 2 * wm * ratio * (4 * gn + 5 * u) + g2 * lip)
                second = 20 * wm * big_g * big_o / big_m**2 * mine[2] + 4 * (wm / big_m + wo / big_o) * big_g * other[2]
                backward(children[i], grads[i], lip * eg + local + second)

        backward(root, 2 * root[0], 2 * root[2])
        return bounds

    def test_pmap_and_training_step_compile_and_differentiate() -> None:
        """A pmapped optax step gives the reference tree's update on every device; and the gradient through the
        collective (reverse mode through ppermute, psum and all_gather) of ``sum(all_reduce(v)**2)`` is, on every
        device, jax.grad of the jnp transcription of the reference tree, within `gradient_bound` for float32."""
        p = 4
        x = np.random.default_rng(1).standard_normal((p, 8, 3)).astype(np.float32)
        y = np.random.default_rng(2).standard_normal((p, 8)).astype(np.float32)
        params = {"w": jnp.ones((3,)), "b": jnp.zeros(())}
        opt = optax.chain(aj.adasum("data"), optax.sgd(0.1))

        def loss(params, x, y):
            return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

        def step(params, state, x, y):
            grads = jax.grad(loss)(params, x, y)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state = opt.init(params)
        pstep = jax.pmap(step, axis_name="data", in_axes=(None, None, 0, 0))
        new, _ = pstep(params, state, x, y)
        for leaf in jax.tree.leaves(new):
            assert all((leaf[w] == leaf[0]).all() for w in range(p))
        grads = [jax.grad(loss)(params, x[w], y[w]) for w in range(p)]
        for name in ("w", "b"):
            combined = tree([np.asarray(g[name]).reshape(-1) for g in grads])
            np.testing.assert_allclose(new[name][0], np.asarray(params[name]) - 0.1 * combined.reshape(
                params[name].shape), rtol=1e-5, atol=1e-6)

        # grad of a function of the collective's result (reverse mode through ppermute/psum/all_gather); the loss is
        # the same on every device, so device w's gradient is d/dv_w of sum(tree(v)**2). p=3 goes through the fold.
        def objective(v):
            return jnp.sum(aj.all_reduce({"v": v[0]}, "data")["v"] ** 2)[None]

        for p in (3, 4):
            v = np.random.default_rng(10 + p).standard_normal((p, 24)).astype(np.float32)
            f = jax.jit(jax.shard_map(jax.grad(lambda v: objective(v).sum()), mesh=mesh(p),
                                      in_specs=P("data"), out_specs=P("data")))
            g = np.asarray(f(jnp.asarray(v)), np.float64)
            with jax.enable_x64(True):
                expected = np.asarray(jax.grad(lambda v: jnp.sum(jnp_tree(list(v)) ** 2))(jnp.asarray(v, jnp.float64)))
                bounds = gradient_bound([v[w] for w in range(p)], U32)
            assert g.shape == (p, 24)
            for w in range(p):
                err = np.linalg.norm(g[w] - expected[w])
                assert err <= bounds[w], f"P={p} device {w}: |grad error| {err:.3g} > bound {bounds[w]:.3g}"

    def test_shard_map_gradients_of_replicated_parameters() -> None:
        """jax.grad w.r.t. replicated params inside shard_map sums over the axis: refused, and `vary`
        gives each device its own gradient, which Adasum then combines like the reference."""
        p = 4
        x = np.random.default_rng(3).standard_normal((p, 8, 3)).astype(np.float32)
        params = {"w": jnp.arange(3.0), "b": jnp.ones(())}

        def loss(params, x):
            return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]))

        def combined(params, x, local):
            grads = jax.grad(loss)(aj.vary(params, "data") if local else params, x)
            return aj.all_reduce(grads, "data"), jax.tree.map(lambda g: g[None], grads)

        def mapped(local):
            return jax.jit(jax.shard_map(lambda params, x: combined(params, x, local), mesh=mesh(p),
                                         in_specs=(P(), P("data")), out_specs=(P(), P("data"))))

        with pytest.raises(ValueError, match="already summed it over the axis.*adasum.jax.vary"):
            mapped(False)(params, x.reshape(p * 8, 3))
        got, per_device = mapped(True)(params, x.reshape(p * 8, 3))
        for name in ("w", "b"):
            mine = np.asarray(per_device[name]).reshape(p, -1)
            own = np.asarray(jax.grad(loss)(params, x[1])[name]).reshape(-1)  # device 1's batch, eagerly
            np.testing.assert_allclose(mine[1], own, rtol=1e-5, atol=1e-5)  # its own gradient, not a sum
            ref, bound = tree_with_bound([mine[w] for w in range(p)], U32, U32)
            assert np.linalg.norm(np.asarray(got[name], np.float64).reshape(-1) - ref) <= bound

    def test_bad_inputs_give_clear_errors() -> None:
        body = jax.shard_map(lambda x: aj.all_reduce({"steps": x}, "data")["steps"], mesh=mesh(2),
                             in_specs=P("data"), out_specs=P("data"))
        with pytest.raises(TypeError, match="leaf 0 has dtype int32.*floating-point"):
            body(jnp.arange(4, dtype=jnp.int32))
        wrong = jax.shard_map(lambda x: aj.all_reduce(x, "batch"), mesh=mesh(2), in_specs=P("data"),
                              out_specs=P("data"))
        with pytest.raises(ValueError, match="axis name 'batch' is not bound"):
            wrong(jnp.ones(4))
        with pytest.raises(ValueError, match="axis name 'data' is not bound"):
            aj.all_reduce(jnp.ones(4), "data")  # outside any mapped function
        with pytest.raises(ValueError, match="devices=N"):
            aj.adacons("data").init(jnp.ones(3))
        with pytest.raises(ValueError, match="momentum"):
            aj.adacons("data", momentum=1.0)
        with pytest.raises(ValueError, match="accumulate=float64 needs"):
            aj.all_reduce(jnp.ones(2), "data", accumulate=jnp.float64)

    def adacons_bound(per_worker: list[np.ndarray], state_total: float, u: float) -> float:
        """First-order bound on |d_computed - d| for AdaCons of one segment in precision u.

        The mean is off by at most ``g_N mean_j |g_j|`` elementwise (in norm: ``dm``); each ``a_i`` by
        ``da = 2 g_n |m| + dm`` (dot and norm, then m's error); sorting and momentum (convex
        combinations) keep that; normalising by ``T = sum max(s, 0)`` gives ``sum |dc_i| <= 2 N da / T``;
        then ``|d| = |m| |sum c_i g_i/|g_i||`` adds ``|m| (2 g_n + g_N + 2u)`` and ``dm``.
        """
        n_workers, n = len(per_worker), per_worker[0].size
        g = [x.astype(np.float64).reshape(-1) for x in per_worker]
        m = sum(g) / n_workers
        dm = gamma(n_workers, u) * np.linalg.norm(sum(np.abs(x) for x in g) / n_workers)
        big_m = np.linalg.norm(m)
        da = 2 * gamma(n, u) * big_m + dm
        return big_m * (2 * n_workers * da / state_total + 2 * gamma(n, u) + gamma(n_workers, u) + 2 * u) + dm

    @pytest.mark.parametrize("p,per_leaf,scale", [(3, False, "mean_norm"), (4, True, "mean_norm"), (8, False, "unit")])
    def test_adacons_matches_reference(p: int, per_leaf: bool, scale: str) -> None:
        beta = 0.9
        opt = aj.adacons("data", momentum=beta, per_leaf=per_leaf, scale=scale, devices=p)
        reference = AdaConsReference(beta=beta, per_tensor=per_leaf, scale=scale)

        def body(state, *leaves):
            out, state = opt.update([x[0] for x in leaves], state)
            return state, *[x[None] for x in out]

        state = opt.init([jnp.zeros(s) for s in SHAPES])
        f = jax.jit(jax.shard_map(body, mesh=mesh(p), in_specs=(P(), *[P("data")] * len(SHAPES)),
                                  out_specs=(P(), *[P("data")] * len(SHAPES))))
        rng = np.random.default_rng(800 + p)
        common = [rng.standard_normal(s) for s in SHAPES]  # a shared direction keeps the a_i positive
        for _ in range(3):
            leaves = [(c + 0.7 * rng.standard_normal((p, *c.shape))).astype(np.float32) for c in common]
            state, *out = f(state, *leaves)
            expected = reference([[x[w] for x in leaves] for w in range(p)])
            segments = [[i] for i in range(len(SHAPES))] if per_leaf else [list(range(len(SHAPES)))]
            for members in segments:
                got = np.concatenate([np.asarray(out[i])[0].reshape(-1) for i in members])
                exp = np.concatenate([expected[i].reshape(-1) for i in members])
                workers = [np.concatenate([leaves[i][w].reshape(-1) for i in members]) for w in range(p)]
                total = sum(max(v, 0.0) for v in reference.states[tuple(int(np.prod(s)) for s in SHAPES)][
                    segments.index(members)])
                bound = adacons_bound(workers, total, U32)
                if scale == "unit":
                    bound /= np.linalg.norm(sum(x.astype(np.float64) for x in workers) / p)
                assert np.linalg.norm(got - exp) <= bound, (np.linalg.norm(got - exp), bound)
                for i in members:
                    o = np.asarray(out[i])
                    assert all((o[w] == o[0]).all() for w in range(p))
        assert int(state.count) == 3

    def test_adacons_identical_gradients_are_kept() -> None:
        p = 5
        opt = aj.adacons("data", devices=p)
        same = np.random.default_rng(9).standard_normal((1, 40)).astype(np.float32).repeat(p, 0)
        f = jax.jit(jax.shard_map(lambda s, x: opt.update(x[0], s)[0][None], mesh=mesh(p),
                                  in_specs=(P(), P("data")), out_specs=P("data")))
        out = np.asarray(f(opt.init(jnp.zeros(40)), same))
        np.testing.assert_allclose(out[0], same[0], rtol=4 * 40 * U32, atol=0)

    @pytest.mark.parametrize("p", (3, 4))
    def test_result_leaves_shard_map_replicated(p: int) -> None:
        """The result is typed as the same on every device, so out_specs=P() (replicated) is accepted."""
        leaves = random_leaves(p, seed=950 + p)
        f = jax.jit(jax.shard_map(lambda *t: aj.all_reduce([x[0] for x in t], "data"), mesh=mesh(p),
                                  in_specs=P("data"), out_specs=P()))
        for a, b in zip(f(*leaves), run(p, leaves)):
            np.testing.assert_array_equal(np.asarray(a), b)

    def test_the_states_old_name_is_a_deprecated_alias() -> None:
        import warnings

        assert isinstance(aj.adasum("data").init(None), aj.AdasumOptaxState)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert aj.AdasumState is aj.AdasumOptaxState
        assert [w.category for w in caught] == [DeprecationWarning] and caught[0].filename == __file__
        assert "renamed adasum.jax.AdasumOptaxState" in str(caught[0].message)
        assert "AdasumState" not in aj.__all__

    def test_adasum_transform_is_all_reduce() -> None:
        p = 3
        leaves = random_leaves(p, seed=900)
        opt = aj.adasum("data")
        f = jax.jit(jax.shard_map(lambda *t: [x[None] for x in opt.update([x[0] for x in t], opt.init(t))[0]],
                                  mesh=mesh(p), in_specs=P("data"), out_specs=P("data")))
        for a, b in zip(f(*leaves), run(p, leaves)):
            np.testing.assert_array_equal(np.asarray(a)[0], b)

    @pytest.mark.parametrize("p", (1, 2))
    def test_pieces_checked_on_every_axis_size(p: int) -> None:
        """A bad `pieces` is refused on an axis of one device too (where nothing is combined), and a float
        count is named, not failed on deep in the layout."""
        for pieces, error, message in ((0, ValueError, "pieces must be an integer >= 1, got 0"),
                                       (-1, ValueError, "pieces must be an integer >= 1, got -1"),
                                       (2.0, TypeError, "pieces must be an integer >= 1, got 2.0")):
            f = jax.shard_map(lambda x: aj.all_reduce(x, "data", pieces=pieces), mesh=mesh(p),
                              in_specs=P("data"), out_specs=P("data"))
            with pytest.raises(error, match=f"adasum.jax.all_reduce: {message}"):
                f(jnp.arange(2.0 * p))

    def test_tuple_axis_names_vary_and_refuse_replicated() -> None:
        """A tuple of axis names is one combined axis everywhere: `vary` types the tree as differing over all
        of them, and replicated gradients are refused, as for a single name."""
        x = np.random.default_rng(4).standard_normal((4, 8, 3)).astype(np.float32)
        w = jnp.arange(3.0)

        def loss(w, x):
            return jnp.sum(jnp.tanh(x @ w))

        def mapped(m, axes, local):
            def step(w, x):
                g = jax.grad(loss)(aj.vary(w, axes) if local else w, x)
                return aj.all_reduce(g, axes), g[None]

            return jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(), P(axes)), out_specs=(P(), P(axes))))

        grid = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
        for m, axes in ((mesh(4), ("data",)), (grid, ("a", "b"))):
            with pytest.raises(ValueError, match="leaf 0 is the same on every device of axis.*adasum.jax.vary"):
                mapped(m, axes, False)(w, x.reshape(32, 3))
            got, per_device = mapped(m, axes, True)(w, x.reshape(32, 3))
            mine = np.asarray(per_device)
            for d in range(4):
                np.testing.assert_allclose(mine[d], np.asarray(jax.grad(loss)(w, x[d])), rtol=1e-5, atol=1e-5)
            ref, bound = tree_with_bound([mine[d] for d in range(4)], U32, U32)
            assert np.linalg.norm(np.asarray(got, np.float64) - ref) <= bound

    def test_adacons_state_from_another_configuration() -> None:
        """A state initialised with the other `per_leaf`, or for a tree of other leaves, is refused by update."""
        p = 2
        leaves = [jnp.ones((p, 3)), jnp.ones((p, 4))]
        whole = aj.adacons("data", momentum=0.5, devices=p)
        per_leaf = aj.adacons("data", momentum=0.5, per_leaf=True, devices=p)

        def update(opt, state):
            f = jax.shard_map(lambda s, a, b: opt.update([a[0], b[0]], s)[1], mesh=mesh(p),
                              in_specs=(P(), P("data"), P("data")), out_specs=P())
            return f(state, *leaves)

        two, three = [jnp.zeros(3), jnp.zeros(4)], [jnp.zeros(3), jnp.zeros(4), jnp.zeros(5)]
        for opt, state, has, needs in ((per_leaf, whole.init(two), 1, "2 (one per leaf)"),
                                       (whole, per_leaf.init(two), 2, "1 (one for the whole tree)"),
                                       (per_leaf, per_leaf.init(three), 3, "2 (one per leaf)")):
            with pytest.raises(ValueError, match=rf"adasum.jax.adacons: the state has momentum for {has} segments, "
                                                 rf"these updates need {re.escape(needs)}"):
                update(opt, state)
        assert update(per_leaf, per_leaf.init(two)).sorted_momentum.shape == (2, p)

    def test_adacons_devices_must_be_a_positive_int() -> None:
        for devices, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
            with pytest.raises(error, match=rf"adasum.jax.adacons: devices must be an integer >= 1, "
                                            rf"got {devices!r}"):
                aj.adacons("data", devices=devices)
        assert aj.adacons("data", devices=np.int64(3)).init(jnp.zeros(2)).sorted_momentum.shape == (1, 3)

    def test_adacons_weights_checks_scale() -> None:
        state = aj.AdaConsState(jnp.zeros((1, 2)), jnp.zeros((), jnp.int32))
        with pytest.raises(ValueError, match=r"scale must be one of \['mean_norm', 'unit'\], got 'mean-norm'"):
            aj.adacons_weights(jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.full((1,), 4.0), state, 0.0, "mean-norm")
