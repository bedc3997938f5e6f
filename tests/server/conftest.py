"""Fixtures shared by the server tests: one agent-API server (two tenants, an admin key, a
small body limit and context) that the Messages and Responses tests both use, so the suite
starts it once. Their assertions compare requests made in the same test, never a fresh cache."""

from __future__ import annotations

import pytest

from testing.agents import agent_server_flags
from testing.server import running_server


@pytest.fixture(scope="session")
def agent_url(tiny_model_dir):
    with running_server(*agent_server_flags(tiny_model_dir)) as url:
        yield url
