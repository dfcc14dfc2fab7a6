"""Evaluation: DDTree / DFlash-chain / AR decoding against an HF target, metrics and reports.

Decoding core (one concept per module): `eval.tree` (THE tree layout, best-first builders), `eval.verify`
(positions + 4-D ancestor mask), `eval.walk` (device tree walk, KV compaction), `eval.target_cache` (the target
cache interface and factory; kinds: `eval.kv_cache` dynamic / static + CUDA graphs, `eval.recurrent_cache` hybrid
Gated-DeltaNet targets, whose layers `eval.tree_recurrent` walks along the tree), `eval.decode` (the one decode loop:
`decode(method, target, drafter, prompt_ids, ...) -> DecodeResult`). Stage: `eval.metrics`, `eval.prompts`,
`eval.report`, `eval.stage`.
"""
