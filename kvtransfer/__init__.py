"""Moving KV-cache bytes between processes: the transfer engines (`kvtransfer.engines`), shared by the worker stub and
the vLLM connector (engines/), which may not import each other."""
