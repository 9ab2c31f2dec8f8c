"""Small widgets the pages reuse: `memory_bars` (a stacked bar per memory tier), `model_menu` (the model pickers'
menu: the built-in model first, the models on this machine, a GGUF file, a checkpoint folder), `about_dialog`
(Help → About: the versions of Hivekeeper, Python, torch, hivemind, PySide6 and Qt), `confirm_dialog` (a
non-blocking "Remove …?" question), `api_switch` (the Chat page's "OpenAI-compatible API on port N" switch, its URL
and status), `plan_run` (the Plan page's "Run this plan" box: prompts file, Run/Stop, predicted against measured
throughput as it runs), `contribution_panel` (the Monitor page's requests, tokens, uptime and energy served,
today and in total), `finetune_panel` (the Chat page's Fine-tune panel: data file, Start/Stop/resume, the
loss curve live; the prompts it saves become the chat's trained prompts), `tray` (the node's state in the tray icon
and the status bar: serving / paused (why) / offline, Pause for 1 hour, Resume, Quit, notifications), `chart` (a
pyqtgraph chart that asks for its minimum height only, and says in words why it is empty instead of bare axes)."""
