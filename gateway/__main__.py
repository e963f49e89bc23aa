"""`python -m gateway` is the `sandbox-gateway` command."""

from gateway.cli import main

raise SystemExit(main())
