"""The running gateway: wiring of core, engines and services, worker processes, the sweeper."""
