"""The app's pages, one module each: hardware, plan, swarm, chat, monitor, models."""
