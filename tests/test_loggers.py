"""The loggers of per-step statistics write files that TensorBoard, MLflow and Weights & Biases read back, with
no network; the Lightning callback hands them to the Trainer's logger. Each framework is imported by the tests
that use it: without its extra they skip, naming it (conftest.py)."""

import csv
import sys

import pytest
import torch

from adasum.loggers import MLflowLogger, TensorBoardLogger, WandbLogger, log_statistics

STEPS = [
    {"step": 1, "skipped_steps": 0, "coefficient_min": 0.5, "coefficient_max": 0.75, "orthogonality": 0.6},
    {"step": 2, "skipped_steps": 1, "coefficient_min": 0.625, "coefficient_max": 1.25, "orthogonality": 0.9},
]


class Owner:
    """Stands for the hook's state or the optimizer: an object with statistics()."""

    def __init__(self, stats):
        self.stats = stats

    def statistics(self):
        return self.stats


def test_tensorboard_logger_writes_scalars_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path / "run")
    for stats in STEPS:
        logger.log(Owner(stats))
    logger.close()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert "adasum/orthogonality" in events.Tags()["scalars"]
    for key in STEPS[0]:
        got = [(e.step, e.value) for e in events.Scalars(f"adasum/{key}")]
        assert got == [(s["step"], pytest.approx(s[key])) for s in STEPS], key


def test_log_statistics_to_a_summary_writer_at_a_given_step_with_lists_flattened(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        written = log_statistics(writer, {"consensus_weights": [0.25, 0.75], "step": 4}, step=10)
    assert written == {"adasum/consensus_weights/0": 0.25, "adasum/consensus_weights/1": 0.75, "adasum/step": 4.0}
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("adasum/consensus_weights/1")] == [(10, 0.75)]


@pytest.fixture(scope="module")
def mlflow_database(tmp_path_factory):
    """A SQLite tracking store, as docs/integrations.md sets it (MLflow 3 refuses the plain file store), made once:
    its tables take seconds to create."""
    import mlflow  # noqa: F401 - skips without the extra
    import sqlalchemy  # noqa: F401

    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def mlflow_store(mlflow_database):
    import mlflow

    mlflow.set_tracking_uri(mlflow_database)
    yield mlflow, mlflow_database
    if mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri("")


def test_mlflow_logger_logs_metrics_the_client_reads_back(mlflow_store):
    from mlflow.tracking import MlflowClient

    mlflow, uri = mlflow_store
    with mlflow.start_run() as run:
        logger = MLflowLogger()  # the active run
        for stats in STEPS:
            logger.log(Owner(stats))
    client = MlflowClient(uri)
    for key in STEPS[0]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"adasum/{key}"))
        assert history == [(s["step"], pytest.approx(s[key])) for s in STEPS], key


def test_log_statistics_to_an_mlflow_run(mlflow_store):
    from mlflow.tracking import MlflowClient

    mlflow, uri = mlflow_store
    run = mlflow.start_run()
    mlflow.end_run()
    log_statistics(run, STEPS[1], step=7)
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "adasum/coefficient_max")
    assert [(m.step, m.value) for m in history] == [(7, 1.25)]


def test_mlflow_logger_without_a_run_says_so(mlflow_store):
    with pytest.raises(RuntimeError, match="start_run"):
        MLflowLogger().log(STEPS[0])


def test_a_logger_without_its_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'adasum\[mlflow\]'"):
        MLflowLogger()
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'adasum\[tensorboard\]'"):
        TensorBoardLogger("unused")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'adasum\[wandb\]' \(from a checkout: pip install '.\[wandb\]'"):
        WandbLogger()


def wandb_history(folder):
    """The history rows of the one offline W&B run under `folder`, read back from its ``.wandb`` file: LevelDB's
    log format (blocks of 32 KiB, records of a 7-byte header: checksum, length, type) of protobuf records."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_logger_logs_an_offline_run_read_back(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="needs the wandb extra: pip install '.[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="adasum-test", dir=str(tmp_path))
    try:
        logger = WandbLogger()  # the active run
        for stats in STEPS[:1]:
            logger.log(Owner(stats))
        log_statistics(run, {**STEPS[1], "consensus_weights": [0.25, 0.75]})
    finally:
        run.finish()
    with pytest.raises(RuntimeError, match=r"call wandb.init\(\) first"):
        WandbLogger().log(STEPS[0])
    rows = wandb_history(tmp_path)
    assert [row["_step"] for row in rows] == [1, 2]
    for row, stats in zip(rows, STEPS):
        assert {k: row[f"adasum/{k}"] for k in stats} == pytest.approx(stats)
    assert (rows[1]["adasum/consensus_weights/0"], rows[1]["adasum/consensus_weights/1"]) == (0.25, 0.75)


def test_the_source_must_have_statistics():
    from torch.utils.tensorboard import SummaryWriter

    with pytest.raises(TypeError, match="statistics"):
        log_statistics(SummaryWriter.__new__(SummaryWriter), object(), step=0)
    with pytest.raises(TypeError, match="SummaryWriter, an MLflow run or a W&B run"):
        log_statistics(object(), STEPS[0])


def test_lightning_callback_logs_the_statistics_through_the_trainers_logger(tmp_path, one_process_group):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    import adasum.lightning

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp_adasum_delta",
        max_steps=3,
        log_every_n_steps=1,
        callbacks=[adasum.lightning.AdasumStatistics()],
        logger=CSVLogger(tmp_path, name="run", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="only one process") as caught:  # the wrapped optimizer combines nothing,
        trainer.fit(  # but counts
            Regression(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=4)
        )
    ours = [str(w.message) for w in caught if str(w.message).startswith("adasum.")]
    assert len(ours) == 1, ours  # the strategy's, not the wrapped optimizer's too
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("adasum/step")]
    assert [(int(r["step"]), float(r["adasum/step"]), float(r["adasum/skipped_steps"])) for r in rows] == [
        (0, 1.0, 0.0),
        (1, 2.0, 0.0),
        (2, 3.0, 0.0),
    ]
