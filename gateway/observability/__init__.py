"""What the gateway tells its operators: the audit trail, Prometheus metrics, its logs."""
