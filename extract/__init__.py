"""The extract stage: target hidden states at the tapped layers, stored for training.

`extract.layers` holds the layer-id convention and tapping; `extract.store` the storage format
(`FeatureReader` is what `train` reads); `extract.inputs` what the stage reads and its plan of units;
`extract.stage` runs the stage with the `hf` or `vllm` backend; `extract.verify` checks features against an HF
forward (`extract --verify`, and the tap check in front of a `vllm` job).
"""
