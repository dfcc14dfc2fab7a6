"""What every stage shares: the typed run config, the stage runner contract (run dirs, manifests,
fingerprints, atomic writes, resume, rank slicing), target loading, the CLI, and the curate /
regen / tokenize stages that prepare the data."""
