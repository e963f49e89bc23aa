"""The metering step's fixtures: the policy of `helpers.metering_step` loaded, and a step
over one process's counters at its fixed time."""

from __future__ import annotations

import pytest
from helpers.metering_step import NOW, POLICY

from gateway.core.policy import PolicySet
from gateway.services.metering import Metering
from gateway.services.policy import load_policy_texts
from gateway.services.state.memory_counters import MemoryCounters


@pytest.fixture
def policies() -> PolicySet:
    return load_policy_texts({"agent.yaml": POLICY})


@pytest.fixture
def metering() -> Metering:
    return Metering(MemoryCounters(lambda: NOW))
