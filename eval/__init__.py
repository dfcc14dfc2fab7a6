"""Evaluation: DDTree / DFlash-chain / AR decoding against an HF target, metrics and reports.

`eval.engine` is the speculative-decoding engine (`decode(method, target, drafter, prompt_ids, ...) -> DecodeResult`
and everything one round needs); it imports nothing of the stage. The stage around it: `eval.stage` (the loop),
`eval.units`, `eval.drafter_inputs`, `eval.conversation`, `eval.lossless`, `eval.overlap`, `eval.metrics`,
`eval.prompts`, `eval.report`, `eval.wandb_log`.
"""
