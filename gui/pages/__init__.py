"""The app's pages, one module each: hardware, plan, swarm, chat, monitor, models, settings
(when the node steps aside for the owner, and its limits)."""
