"""regen: the target writes every assistant turn of the curated conversations (on-policy data).

`stage` runs the stage (units, resume, manifest) and picks the backend; `generator` is the one interface
every backend implements (`Generator`: load / generate / close) and the sampling rules they share;
`hf` (transformers; `static_decode` is its static-KV + CUDA-graph fast path) and `vllm` are the backends;
`conversation` is the turn structure and prompt encoding that regen and tokenize share.
Imports go stage -> backends -> generator, never back.
"""
