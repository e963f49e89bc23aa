"""Outbound credential detection's detectors, built from Yelp's detect-secrets plugins
(`library`) plus the provider keys it lacks (`plugins`). The scan itself is pure and
lives in `gateway/core/dlp/`."""
