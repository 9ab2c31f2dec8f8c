"""A swarm client.

- `routing`    choosing servers for a chain of blocks and banning failing ones (pure logic).
- `inference`  reading the swarm, inference sessions that replay history onto a replacement server, SwarmModel.
- `spot_check` re-running sampled steps elsewhere to catch servers that return wrong outputs (tolerance, referee).
"""
