"""The file names of a Hugging Face checkpoint folder: the weights (one file or shards listed in an index) and the
small files a client wants beside them. Kept apart from checkpoint.py, which imports torch, so that `hivekeeper models
pull` (hub_library) chooses a repo's files without paying torch's import (seconds on a loaded machine)."""

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# small files a client wants next to the weights (tokenizer, chat template, generation defaults)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
