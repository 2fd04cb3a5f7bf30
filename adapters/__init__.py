"""Adapters that join real inference engines (vLLM, SGLang) to kvdir: their KV-cache events decoded and
mapped to kvdir's block hashes (`kv_events`), and the subscriber that turns them into directory writes
(`subscriber`). A client of the directory like the gateway and the worker: it never imports the server.
"""
