"""Where the reducers meet training: the DDP communication hook (`ddp`), the distributed optimizer
(`optim`: gradients or optimizer deltas) and SlowMo (`slowmo`)."""
