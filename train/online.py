"""Online mode (`train.online=true`): read the tokenize stage's output and compute the target features inside
the training step, with the same tap code as offline extraction (`extract.layers.forward_taps`), so the loss of
a batch is the same whether its features were stored or computed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.errors import StageError
from pipeline.stage_dir import StageDir
from pipeline.tokenize import TOKENIZED_SCHEMA


class TokenizedReader:
    """The tokenize stage's parquet shards as a sample source (`ids`, `lengths`, `num_loss_tokens`, `sample(i)`
    without features).

    Columns: `pipeline.tokenize.TOKENIZED_SCHEMA`. Shards are checked against their sidecars (a damaged one is a
    DamagedFile naming it) and memory-mapped.
    """

    def __init__(self, stage_path: str | Path):
        import pyarrow as pa

        path = Path(stage_path)
        files = sorted((path / "shards").glob("*.parquet"))
        if not files:
            raise StageError(f"{path}/shards has no parquet shards: run `drafter tokenize` first")
        stage = StageDir(path.parent, path.name)
        self.table = pa.concat_tables([stage.read_shard(f, columns=TOKENIZED_SCHEMA.names, schema=TOKENIZED_SCHEMA,
                                                        memory_map=True, verify=True) for f in files])
        self.ids: list[str] = self.table.column("id").to_pylist()
        self.lengths: np.ndarray = self.table.column("num_tokens").to_numpy().astype(np.int64)
        self.num_loss_tokens: np.ndarray = self.table.column("num_loss_tokens").to_numpy().astype(np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, i: int) -> dict:
        ids = self.table.column("input_ids")[i].values.to_numpy(zero_copy_only=False)
        mask = self.table.column("loss_mask")[i].values.to_numpy(zero_copy_only=False)
        return {"id": self.ids[i], "input_ids": torch.from_numpy(ids.astype(np.int64)),
                "loss_mask": torch.from_numpy(mask.astype(bool))}


def open_tokenized(run_dir: Path) -> TokenizedReader:
    return TokenizedReader(StageDir(run_dir, "tokenize").path)


class OnlineFeatures:
    """Target features of a collated micro-batch, computed now: [1, S, n*D] for the packed row.

    The packed row is split into its sequences, right-padded into one [n_seq, max_len] batch (right padding is
    exact for the real tokens of a causal target) and run through layers 0..max(layer_ids) only, by `forward`
    (`fn(model, input_ids, layer_ids)`: `extract.layers.forward_taps`, or the compiled layer loop that offline
    extraction uses, `extract.hf.compiled_forward`).
    """

    def __init__(self, target: torch.nn.Module, layer_ids: list[int], max_tokens_per_forward: int = 1 << 16,
                 forward=None):
        from extract.layers import forward_taps

        self.target = target
        self.layer_ids = list(layer_ids)
        self.max_tokens = max_tokens_per_forward
        self.forward = forward or forward_taps

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        device = next(self.target.parameters()).device
        seqs = list(torch.split(input_ids, list(seq_lens)))
        out = []
        for group in self._groups(seq_lens):
            width = max(seq_lens[i] for i in group)
            batch = torch.zeros(len(group), width, dtype=torch.long)
            for r, i in enumerate(group):
                batch[r, : seq_lens[i]] = seqs[i]
            feats = self.forward(self.target, batch.to(device, non_blocking=True), self.layer_ids)  # [b, width, n*D]
            out += [feats[r, : seq_lens[i]] for r, i in enumerate(group)]
        return torch.cat(out)[None]

    def _groups(self, seq_lens: list[int]) -> list[list[int]]:
        """Consecutive sequences per target forward, at most `max_tokens` padded tokens each."""
        groups, cur, width = [], [], 0
        for i, n in enumerate(seq_lens):
            if cur and max(width, n) * (len(cur) + 1) > self.max_tokens:
                groups.append(cur)
                cur, width = [], 0
            cur.append(i)
            width = max(width, n)
        return groups + ([cur] if cur else [])
