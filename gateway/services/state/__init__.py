"""State every worker shares: revocations, sandbox addresses, counters, shared mints
(in memory, in SQLite, in Redis)."""
