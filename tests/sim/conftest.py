"""Fixtures of the simulator tests: a real redis-server per test."""

from tests.redis_server import redis_server  # noqa: F401 - the fixture
