"""The checks every combining path passes before data moves, between the transport and the collectives: the
cross-rank agreement on layouts and configurations (`agreement`, one helper and its asynchronous form), the plan
per (group, layout, configuration) whose verdicts every entry point asks for (`plan`), the thread that compares
deferred checks on NCCL (`guard`), and the non-finite policy (`nonfinite`)."""
