"""The Petals-compatible swarm.

- `protocol`  the wire format on hivemind: handler names, packed arguments, tensors, schemas.
- `dht`       the swarm's state in the DHT: who serves which blocks, in what state, how fast.
- `contribution` what this node has served (requests, tokens, uptime, energy), kept across restarts.
- `directory` the models a swarm serves (its registry), their coverage, where this machine would help most.
- `status`    the status report built from it (`hivekeeper swarm status`, the app's coverage chart).
- `local`     `hivekeeper serve` child processes on this machine: a loopback swarm.
- `bootstrap` the default swarm's peers: the public Petals swarm's, or HIVEKEEPER_BOOTSTRAP_PEERS (tests, CI).
- `server/`   serving a span: lifecycle, RPC handlers, KV memory pool, throughput.
- `client/`   using a swarm: routing and inference sessions that survive server failures.
"""
