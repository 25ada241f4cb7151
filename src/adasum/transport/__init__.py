"""How bytes move between ranks: process-group facts and named failures (`groups`), and the
transports the collectives' schedules run on (`c10d`: point-to-point through torch.distributed)."""
