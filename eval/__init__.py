"""Evaluation: DDTree / DFlash-chain / AR decoding against an HF target, metrics and reports.

Decoding core (one concept per module): `eval.engine.tree` (THE tree layout, best-first builders), `eval.engine.verify`
(positions + 4-D ancestor mask), `eval.engine.walk` (device tree walk, KV compaction), `eval.engine.cache.interface` (the target
cache interface and factory; kinds: `eval.engine.cache.kv` dynamic / static + CUDA graphs, `eval.engine.cache.hybrid` hybrid
Gated-DeltaNet targets, whose layers `eval.engine.tree_recurrent` walks along the tree), `eval.engine.decode` (the one decode loop:
`decode(method, target, drafter, prompt_ids, ...) -> DecodeResult`). Stage: `eval.metrics`, `eval.prompts`,
`eval.report`, `eval.stage`.
"""
