"""Services the core's decisions rest on: policy, secrets, minting, metering, identity, state."""
