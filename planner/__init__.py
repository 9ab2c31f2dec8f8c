"""Hivekeeper's planner: hardware and model specs, the cost model, policy search and swarm sizing.

Pure Python (numpy allowed). It never imports torch, Qt or hivemind, so `import hivekeeper.planner` stays light.
"""
