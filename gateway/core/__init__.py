"""The enforcement core: every decision, made once, for every engine (no engine imports)."""
