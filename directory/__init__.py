"""kvdir's directory server: the Raft replica (`replica`, `raft_transport`, `journal`), its REST API (`api`,
`auth`, `tenancy`, `watch`, `changefeed`), settings and metrics. Only replica processes import it; the protocol
its clients speak, and the state machine it replicates, are in `kvproto`."""
