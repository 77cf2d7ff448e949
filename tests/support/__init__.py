"""Helpers the tests share (imported as ``tests.support.<module>``); fixtures are in
tests/conftest.py."""
