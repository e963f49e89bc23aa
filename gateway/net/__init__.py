"""Network plumbing the engines share: checked, pinned resolution and memory-BIO TLS."""
