"""The target's cache behind one interface (`interface.TargetCache`), picked by one factory
(`factory.target_cache`): `kv.KVTargetCache` for attention-only targets, `hybrid.HybridTargetCache` (and its
path-batched reference) for Gated-DeltaNet hybrids."""
