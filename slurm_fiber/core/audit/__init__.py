"""The audit trail: one durable record per decision, its fsync helper, and the socket's refusals."""
