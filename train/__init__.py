"""Train stage: the DFlash drafter (model, blocks, loss, export) and its trainer (data, engine, checkpoint, metrics)."""
