"""Adapters that join real inference engines (vLLM, SGLang) to kvdir.

Their KV-cache events: framed (`event_wire`), decoded (`engine_events`), mapped to kvdir's block hashes
(`hash_mapper`, `extra_keys`) and turned into directory writes by `kvdir events` (`subscriber`: one engine's
stream in `engine_stream`, the directory side in `node_feed`). And the vLLM KV connector (`vllm_connector`, a
facade over `connector_scheduler` and `connector_worker`; its pure logic in `vllm_plan`). A client of the directory like the gateway and the worker: it never imports the
server.
"""
