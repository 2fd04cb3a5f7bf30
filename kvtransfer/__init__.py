"""Moving KV-cache bytes between processes: the transfer engines (`kvtransfer.backends`), shared by the worker stub and
the vLLM connector (adapters/), which may not import each other."""
