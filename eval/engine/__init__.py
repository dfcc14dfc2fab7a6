"""The speculative-decoding engine: one round (draft -> build tree -> verify -> walk -> commit) and everything it
needs, importing nothing of the eval stage (tests/repo/test_module_map.py holds it to that).

    decode(method, target, drafter, prompt_ids, ...) -> DecodeResult        eval.engine.decode (AR / chain / DDTree)

The round's pieces, one concept per module: `tree` (THE tree layout, best-first builders), `verify` (positions + the
ancestor mask), `walk` (device tree walk, K/V compaction), `round_record` (the round's one device-to-host read),
`draft_forward` (the drafter's graphed step), `target_forward` (the target's fused verify forward),
`tree_recurrent` (Gated-DeltaNet layers along a tree), `cache/` (the target cache: one interface, one factory, the
K/V and hybrid kinds). A Triton kernel sits beside the torch function it must equal, in `<module>_triton.py`
(`tree_triton`, `verify_triton`, `walk_triton`, `target_forward_triton`, `tree_recurrent_triton`);
`pipeline.triton_runtime` decides whether they run.
"""
