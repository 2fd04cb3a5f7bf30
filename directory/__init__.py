"""kvdir's directory, in two halves (docs/architecture.md, "Import layers"; import-linter checks the direction).

The protocol and the client, which every component imports: `hashing`, `schemas`, `errors`,
`tokenizer`, `client`, `session`, `client_settings`, `addresses`, `http_limits`, `logs`. The server, which only
replica processes import: `api`, `replica`, `state`, `index`, `journal`, `raft_transport`, `auth`,
`tenancy`, `config`, `metrics`, `server`.
"""
