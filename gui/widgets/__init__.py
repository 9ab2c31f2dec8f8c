"""Small widgets the pages reuse: `memory_bars` (a stacked bar per memory tier)."""
