"""A local OpenAI-compatible HTTP API over one model (`hivekeeper api`), so editors, notebooks and scripts written
for OpenAI's API talk to a local or swarm model unchanged.

Map:
- `schema`  the requests it accepts (/v1/chat/completions, /v1/completions), checked field by field, and the
            OpenAI-shaped error (status, message naming the field) a bad one gets.
- `server`  the HTTP server (stdlib, one request at a time; others wait in the listen queue), the endpoints, and the
            responses: JSON, or server-sent events with `stream: true`.
"""
