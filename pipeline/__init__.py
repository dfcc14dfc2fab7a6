"""What every stage shares: the typed run config, the stage runner contract (run dirs, manifests,
fingerprints, atomic writes, resume, rank slicing), target loading, and the curate / regen / tokenize
stages that prepare the data. The CLI that runs the stages is the `drafter` package above them."""
