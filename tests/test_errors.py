"""`ConfigError` (gateway/errors.py): one class for a wrong value wherever it is read - the
core's durations, the configuration, the policy readers - and still a `ValueError`."""

from __future__ import annotations

import pytest

import gateway.config
from gateway.core.durations import parse_duration
from gateway.errors import ConfigError


def test_it_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_the_configuration_and_the_core_raise_the_same_class() -> None:
    assert gateway.config.ConfigError is ConfigError
    assert gateway.config.parse_duration is parse_duration
    with pytest.raises(ConfigError, match=r"^budget\.window: 'soon' is not a duration"):
        parse_duration("soon", "budget.window")
    with pytest.raises(ConfigError, match=r"^<defaults>: workers: expected a non-negative"):
        gateway.config.load_config(None, env={"SANDBOX_GATEWAY_WORKERS": "many"})
