"""Public path of the loggers of per-step statistics (TensorBoard: ``pip install 'adasum[tensorboard]'``;
MLflow: ``pip install 'adasum[mlflow]'``): ``adasum.loggers.TensorBoardLogger``, ``MLflowLogger`` and
``log_statistics`` (implemented in `adasum.integrations.loggers`)."""

from adasum.integrations.loggers import MLflowLogger, TensorBoardLogger, log_statistics, scalars

__all__ = ["MLflowLogger", "TensorBoardLogger", "log_statistics", "scalars"]
