"""`kvdir bench`: benchmarks that print figures (targets are judged from these, never in tests)."""
