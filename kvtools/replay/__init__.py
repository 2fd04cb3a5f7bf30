"""Offline trace replay: Mooncake traces and synthetic workloads through the gateway's routing policies."""
