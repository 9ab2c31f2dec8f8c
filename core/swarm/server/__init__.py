"""A swarm server.

- `server`      its life: join, choose and load a span, announce it, serve, rebalance, leave.
- `handler`     the RPC handlers (`TransformerConnectionHandler.*`): check input, then run named steps.
- `compute`     the one compute thread, by priority: inference steps before forward/backward.
- `quotas`      per-peer and server-wide quotas (sessions, requests, bytes in flight); over one: "server busy".
- `memory`      the KV-cache memory pool shared by all sessions.
- `throughput`  how fast this node serves a block: timed on one block as served, cached with when and at what load.
- `pause`       stepping aside for the owner: pause conditions, their platform providers, resource limits (flags).
"""
