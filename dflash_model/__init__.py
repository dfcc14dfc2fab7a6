"""The DFlash drafter model, importable by the trainer and the evaluator alike (as z-lab's `dflash/model.py` is by
its trainer and server): `dflash_model.model` (the drafter: fusion, KV injection, layers; training and inference
forward), `dflash_model.blocks` (THE anchor / block / mask / label rules) and `dflash_model.export` (the z-lab DFlash
checkpoint layout, in and out). Named `dflash_model`, not `dflash`, so it never shadows z-lab's own `dflash`
package in an environment that has both, and apart from `drafter/` (our CLI)."""
