"""Public path of the loggers of per-step statistics (TensorBoard: ``pip install 'adasum[tensorboard]'``;
MLflow: ``pip install 'adasum[mlflow]'``; Weights & Biases: ``pip install 'adasum[wandb]'``):
``adasum.loggers.TensorBoardLogger``, ``MLflowLogger``, ``WandbLogger`` and ``log_statistics`` (implemented in
`adasum.integrations.loggers`)."""

from adasum.integrations.loggers import MLflowLogger, TensorBoardLogger, WandbLogger, log_statistics, scalars

__all__ = ["MLflowLogger", "TensorBoardLogger", "WandbLogger", "log_statistics", "scalars"]
