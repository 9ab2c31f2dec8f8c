"""The `hivekeeper` command: `main` dispatches to one module per subcommand.

Each module has `add_arguments(parser)` and `run(args) -> int`: app, chat, demo_model, detect, generate, measure,
plan, profile, serve, swarm, node (node stats: what this machine has served).
"""
