"""kvdir's tools: benchmarks, the trace replay and the fault harness, apart from the library.

They plug into the `kvdir` command through the `kvdir.commands` entry points (pyproject.toml), so nothing in
`kvdir` or the services imports them; the import-linter layers contract keeps it so.
"""
