"""Tests of services.decode: the pull connector and its admission step."""
