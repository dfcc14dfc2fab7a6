"""The curate stage: sources -> adapters -> cleaning -> exact + MinHash dedup -> eval split + mixture ->
parquet shards with a report. Entry point: `pipeline.curate.stage.run_curate`.

    sources.py   where records come from (local jsonl/json/parquet, hub datasets) and reading units
    adapters.py  dataset layouts -> the conversation schema (schema.py)
    clean.py     drop rules, each with a named reason
    dedup.py     exact keys, MinHash signatures (datasketch), LSH near-duplicates
    chunks.py    the reading phase, one checkpointed work file per chunk, in worker processes
    mix.py       eval split, per-source up/down-sampling, shuffle
    report.py    stats.json / report.md
    stage.py     the stage: phases, resume, manifest
    synthetic.py synthetic conversations with known duplicates and defects (benchmarks, tests)
"""
