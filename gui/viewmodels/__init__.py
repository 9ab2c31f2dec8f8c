"""Qt-free models of what the app shows: `plan_view` (the Plan page's panels), `conversations`, `ring_buffer`,
`models_view` (the Models page's rows, the pickers' entries, a pull's progress in words)."""
