"""The pipeline: what the engines call, between them and the services.

Each unit has one job and holds the state it needs (connection counts, identities, leak
markers, an exchange in flight); it decides with the pure core (``gateway.core``) and
reaches the services (tokens, the policy set, the destination guard, secrets, metering,
approvals) only through the ports of ``core/ports.py``, which ``runtime/app.py`` wires.
"""
