"""The extract stage: target hidden states at the tapped layers, stored for training.

`extract.layers` holds the layer-id convention and tapping; `extract.store` the storage format
(`FeatureReader` is what `train` reads); `extract.stage` runs the stage with the `hf` or `vllm` backend.
"""
