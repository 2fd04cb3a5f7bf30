"""What every kvdir process speaks and shares: the protocol package (docs/architecture.md, "Import layers").

- The wire: `hashing` (chained block hashes, the KV identity), `schemas` (the REST bodies), `binary` (the
  msgpack batches), `errors`, `shardmap`, `addresses`, and `openai_api` (the OpenAI request shapes, their
  parsing and limit checks, and the OpenAI error body).
- The replicated state machine and its stream: `state` and `index` (pure and deterministic: the directory
  replicates them under Raft, the gateway's mirror applies the same commands) and `codec` (the one versioned
  encoding of what Raft carries of them, entries and snapshots, and of the watch stream).
- The directory's client: `client`, `session`, `client_settings`.
- The HTTP plumbing every server uses: `http_limits`, `heap`, `logs`, `offline_docs`, `rate_limit`, `tokenizer`.

It imports none of the services (the directory server, the gateway, the worker, the adapters) nor the tools.
"""
