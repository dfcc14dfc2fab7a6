"""The curated conversation: the one row schema every source is turned into (docs/design.md, "curate").

    id:       string   stable `<source>/<record index>` (`.k` for the k-th instance of a multi-instance
                       record, `#rN` for the N-th extra copy of an up-sampled conversation)
    source:   string   the source's `name` from the config
    messages: list<struct<role: string, content: string>>
              roles `system|user|assistant`; an optional system turn, then a user turn first;
              assistant turns may be absent (MT-Bench style prompts)
    metadata: string   JSON: `format`, `location` (file:line, file[i], file#row or hub:id/split#i) and the
                       record's short scalar fields that the adapter did not consume

Work files (one per reading unit, see `pipeline/curate/chunks.py`) hold the same columns plus what dedup,
mixing and the report need, so the final shards are a pure `take` from them.
"""

from __future__ import annotations

import pyarrow as pa

ROLES = ("system", "user", "assistant")

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

CONVERSATION_SCHEMA = pa.schema(
    [("id", pa.string()), ("source", pa.string()), ("messages", pa.list_(MESSAGE)), ("metadata", pa.string())]
)

KEY_BYTES = 16  # exact-dedup key: blake2b-128 of the normalized prompt side


def work_schema(num_perm: int | None) -> pa.Schema:
    """Schema of a work file: the conversation columns plus

    chars: int32 (all turns), prompt_chars: int32 (system+user turns), turns: int16,
    key: fixed_size_binary[16], and with near-dedup on, minhash: fixed_size_list<uint32>[num_perm].
    """
    fields = list(CONVERSATION_SCHEMA) + [
        pa.field("chars", pa.int32()),
        pa.field("prompt_chars", pa.int32()),
        pa.field("turns", pa.int16()),
        pa.field("key", pa.binary(KEY_BYTES)),
    ]
    if num_perm:
        fields.append(pa.field("minhash", pa.list_(pa.uint32(), num_perm)))
    return pa.schema(fields)
