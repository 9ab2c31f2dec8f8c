"""Fine-tuning trainable prompts while the model's blocks stay frozen, locally or through a swarm (issue 21).

- `data`     the training file (JSON lines: chat messages or prompt/completion pairs) as token ids and loss masks;
             a bad line is one InputError naming the file and the line.
- `prompts`  the trainable prompts ("ptune": soft prompt tokens; "deep_ptune": those plus one prompt per block) and
             their safetensors file (model id, method, step and the optimizer's state in its metadata and tensors).
- `blocks`   the frozen blocks as one differentiable function of (hidden, deep prompts): run here, or through the
             swarm's rpc_forward / rpc_backward hop by hop (a failing server raises HopFailed, with its peer).
- `trainer`  the training loop: batches, loss, Adam on the prompts, a progress callback, resume, and a step redone
             on a replacement server when one fails mid-step.
- `prompted` a runner that generates with trained prompts (chat, generate and the API's `--prompts FILE`).
"""
