"""A sweep's Optuna study: where it is stored, a job's side of its trial, and what is read back from it
(the queries, the report, the W&B report, the dashboard)."""
