"""Work off the GUI thread, as QObjects with signals.

- `workers`        a function on a QThread with an abort flag.
- `collector`      cyclic garbage collected on the GUI thread while a window is open or a worker runs.
- `child_process`  a child process that reports one JSON object per line (QProcess).
- `hardware`, `hardware_probe`  this machine, detected in a child process; `measure` the Measure button and the
  automatic quick measurement of a machine never measured (FirstMeasure).
- `chat`, `chat_backends`  chat generation on a worker, locally or through a swarm.
- `node`           the serving node as a child process; `coverage`, `swarm_watch` the swarm's coverage and its
  models (the registry, where this machine would help).
- `system_usage`   CPU, RAM and GPU use, sampled.
- `api_server`     the OpenAI-compatible API (`hivekeeper api --json-status`) as a child process.
- `batch_run`      the Plan page's "Run this plan": a batch generation of the plan shown on a worker, with Stop.
- `models`         the model library: listing and removing on a worker, pulling as a child process.
"""
