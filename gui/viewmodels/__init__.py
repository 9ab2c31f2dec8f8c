"""Qt-free models of what the app shows: `plan_view` (the Plan page's panels), `conversations`, `ring_buffer`."""
