"""Train stage: the DFlash drafter's training (loss, data, engine, checkpoint, metrics, trainer); the model itself is
`dflash_model`."""
