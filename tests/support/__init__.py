"""Test harness code shared across tiers: polling with a deadline, free ports, cluster queries, an in-memory replica.

Fixtures stay in each tier's conftest.py; the helpers they and the tests use live here.
"""
