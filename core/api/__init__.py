"""A local OpenAI-compatible HTTP API over one model (`hivekeeper api`), so editors, notebooks and scripts written
for OpenAI's API talk to a local or swarm model unchanged.

Map:
- `schema`  the requests it accepts (/v1/chat/completions, /v1/completions), checked field by field, and the
            OpenAI-shaped error (status, message naming the field) a bad one gets.
- `service` the model behind it: the checks that need the model, the engine that generates (continuous batching
            when the blocks are in memory, runtime/continuous.py), the OpenAI response objects.
- `server`  the ASGI app (Starlette, served by uvicorn): endpoints, API key, body limit, concurrent requests handed
            to the engine; JSON replies, or server-sent events with `stream: true`.
"""

# where `hivekeeper api` and the app's API switch listen unless told otherwise (loopback: this machine only)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
