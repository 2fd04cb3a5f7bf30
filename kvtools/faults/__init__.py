"""The fault harness (Jepsen-style): a history of operations, injected faults, and a checker."""
