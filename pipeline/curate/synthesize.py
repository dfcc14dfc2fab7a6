"""Prompts the target writes itself (Magpie-style): a curate source that needs no dataset, on the target's own
distribution, for any target with a chat template.

    prefix    the chat template rendered with one placeholder user message (after `synthesize.system` when set):
              the text before the placeholder is the user prefix (ChatML: "<|im_start|>user\\n", after the
              template's default system turn if it has one); the first token after the placeholder, when it is a
              special token, ends the turn (with the tokenizer's EOS and generation_config's eos ids)
    generate  the target continues the prefix (hf backend: batched `generate` through `pipeline.regen.hf`, sampled
              with `synthesize.temperature/top_p/top_k`) until the end of its turn or `max_new_tokens`
    filter    every generation is kept or dropped under exactly one reason, the first rule it fails (REASONS)
    dedup     a prompt equal to an earlier kept one after curate's normalization (lower case, whitespace
              collapsed) is dropped as `duplicate`; curate's exact and near dedup then run over all sources

Units of resume: unit k holds attempts [k*B, (k+1)*B) with B = `synthesize.batch_size`, sampled from one seed
derived from (run seed, source name, k). Its kept prompts go to `<curate>/work/synth-<name>/shards/unit-NNNNN.jsonl`
({"prompt": ..., "attempt": i}) with a sidecar holding its counts per reason and the first examples. Units run in
order until `count` unique prompts are kept (the last unit keeps only the missing ones) or `max_attempts` are
spent. The output is a function of target, settings and seed: a killed run redoes only the unfinished unit and
writes the same files.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import RunConfig, SynthesizeConfig
from pipeline.curate.dedup import normalize
from pipeline.log import get_logger, progress
from pipeline.errors import StageError
from pipeline.files import AtomicFile
from pipeline.stage_dir import StageDir
from pipeline.target import OpenedTarget, render_chat

PLACEHOLDER = "Xq7PlaceholderUserText"
REASONS = ("truncated", "template_tokens", "empty", "undecodable", "control_chars", "too_short", "too_long",
           "few_letters", "not_latin", "repetitive", "duplicate")
EXAMPLES_PER_REASON = 3
EXCERPT_CHARS = 160
LATIN_SHARE = 0.9        # script 'latin': at least this share of the letters are Latin
REPEAT_RUN = 16          # the same character this many times in a row
REPEAT_MIN_WORDS = 10    # with at least this many words,
REPEAT_UNIQUE_SHARE = 0.3  # fewer distinct words than this share is repetitive
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_RUN = re.compile(r"(\S)\1{%d,}" % (REPEAT_RUN - 1))
log = get_logger("curate.synthesize")


@dataclass(frozen=True)
class UserPrefix:
    """What the target is given and where its turn ends."""

    text: str             # the rendered chat up to where the user's text would start
    ids: list[int]        # its token ids (no special tokens added: the template writes them)
    stop_ids: list[int]   # the turn's end: the token after the placeholder (if special) + the EOS ids
    end_of_turn: str      # that token's text ('' when the template has none)


def user_prefix(tokenizer, *, system: str | None, enable_thinking: bool, location: str | None = None) -> UserPrefix:
    """The user prefix of the target's chat template (module docstring). Raises StageError when the template does
    not render a user message's text verbatim (no prefix to find)."""
    from pipeline.regen.conversation import encode_chat, end_of_turn_ids

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": PLACEHOLDER}]
    text = render_chat(tokenizer, messages, add_generation_prompt=False, enable_thinking=enable_thinking)
    at = text.find(PLACEHOLDER)
    if at < 0:
        raise StageError("curate synthesize: the target's chat template does not render a user message's text as it "
                         "is, so there is no user prefix to give it")
    prefix, rest = text[:at], text[at + len(PLACEHOLDER):]
    stops = set(end_of_turn_ids(tokenizer, location))
    after = encode_chat(tokenizer, rest)
    end = ""
    if after and after[0] in set(tokenizer.all_special_ids) | _added_special_ids(tokenizer):
        stops.add(after[0])
        end = tokenizer.convert_ids_to_tokens(after[0])
    return UserPrefix(prefix, encode_chat(tokenizer, prefix), sorted(stops), end)


def _added_special_ids(tokenizer) -> set[int]:
    return {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}


def template_markers(tokenizer) -> list[str]:
    """The text of every special token (role markers, turn ends, ...): a prompt holding one is dropped."""
    names = set(tokenizer.all_special_tokens)
    names |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    return sorted(n for n in names if n)


def judge(text: str, finish_reason: str, s: SynthesizeConfig, markers: list[str]) -> str | None:
    """The first rule of REASONS (all but `duplicate`) that `text` (decoded with special tokens, untrimmed) fails;
    None when it is a usable prompt."""
    if finish_reason != "stop":
        return "truncated"
    if any(m in text for m in markers):
        return "template_tokens"
    text = text.strip()
    if not text:
        return "empty"
    if "\ufffd" in text or any("\ud800" <= c <= "\udfff" for c in text):
        return "undecodable"
    if _CONTROL.search(text):
        return "control_chars"
    if len(text) < s.min_chars:
        return "too_short"
    if len(text) > s.max_chars:
        return "too_long"
    visible = [c for c in text if not c.isspace()]
    letters = [c for c in visible if c.isalpha()]
    if len(letters) < s.min_letter_share * len(visible):
        return "few_letters"
    if s.script == "latin" and sum(_is_latin(c) for c in letters) < LATIN_SHARE * len(letters):
        return "not_latin"
    words = text.lower().split()
    if _RUN.search(text) or (len(words) >= REPEAT_MIN_WORDS and len(set(words)) < REPEAT_UNIQUE_SHARE * len(words)):
        return "repetitive"
    return None


def _is_latin(c: str) -> bool:
    o = ord(c)
    return o < 0x250 or 0x1E00 <= o <= 0x1EFF  # Basic Latin .. Latin Extended-B, Latin Extended Additional


def unit_seed(seed: int, name: str, unit: int) -> int:
    return zlib.crc32(f"{seed}:{name}:{unit}".encode()) & 0x7FFFFFFF


def synth_dir(work: StageDir, name: str) -> StageDir:
    return StageDir(work.path, f"synth-{name}")


def record(cfg: RunConfig, target: OpenedTarget, s: SynthesizeConfig) -> dict:
    """What decides a synthesized source's prompts beyond its settings: the target (identity, thinking flag)."""
    return {"target": target.fingerprint, "enable_thinking": cfg.target.enable_thinking,
            "settings": dataclasses.asdict(s)}


def synthesize(cfg: RunConfig, index: int, target: OpenedTarget, work: StageDir) -> tuple[list[tuple[str, str]], dict]:
    """Run (or resume) the units of source `index`; returns ([("jsonl", unit file)], stats for the curate report)."""
    source = cfg.curate.sources[index]
    s = source.synthesize
    out = synth_dir(work, source.name)
    out.shards.mkdir(parents=True, exist_ok=True)
    prefix = user_prefix(target.tokenizer, system=s.system, enable_thinking=cfg.target.enable_thinking,
                         location=target.location)
    markers = template_markers(target.tokenizer)
    max_attempts = s.max_attempts or 4 * s.count
    seen: set[str] = set()
    counts: Counter = Counter()
    examples: dict[str, list] = {}
    files: list[tuple[str, str]] = []
    generator = None
    bar = progress(total=s.count, desc=f"curate synthesize {source.name}", unit="prompt")
    started = time.time()
    k = 0
    try:
        while len(seen) < s.count and k * s.batch_size < max_attempts:
            unit = f"unit-{k:05d}"
            path = out.shard_path(unit, "jsonl")
            done = out.unit_done(unit)
            if done is None:
                if generator is None:
                    generator = _generator(cfg, target, prefix, s)
                n = min(s.batch_size, max_attempts - k * s.batch_size)
                outs = generator.generate([prefix.ids] * n, [s.max_new_tokens] * n,
                                          [unit_seed(cfg.seed, source.name, k)] * n)
                done = _write_unit(out, unit, path, k * s.batch_size, outs, target.tokenizer, s, markers, seen,
                                   s.count - len(seen))
            for line in path.read_text(encoding="utf-8").splitlines():
                seen.add(normalize(json.loads(line)["prompt"]))
            counts.update(done["counts"])
            for reason, ex in done["examples"].items():
                bucket = examples.setdefault(reason, [])
                bucket += ex[: max(0, EXAMPLES_PER_REASON - len(bucket))]
            files.append(("jsonl", str(path)))
            bar.update(done["counts"].get("kept", 0))
            k += 1
    finally:
        bar.close()
        if generator is not None:
            generator.close()
    if len(seen) < s.count:
        log.warning("source %r: %d of %d prompts kept after %d attempts (synthesize.max_attempts); dropped: %s",
                    source.name, len(seen), s.count, counts["attempts"], {r: counts[r] for r in REASONS if counts[r]})
    stats = {"prefix": prefix.text, "end_of_turn": prefix.end_of_turn, "attempts": counts["attempts"],
             "kept": counts["kept"], "not_needed": counts["not_needed"], "wanted": s.count, "units": k,
             "dropped": {r: counts[r] for r in REASONS if counts[r]}, "examples": examples,
             "seconds": round(time.time() - started, 3)}
    return files, stats


def _generator(cfg: RunConfig, target: OpenedTarget, prefix: UserPrefix, s: SynthesizeConfig):
    """The target on the hf backend (`pipeline.regen.hf.HFGenerator`: batched, vocab-limited, stops at the turn's end)
    with this source's sampling and batch size; `regen.hf_decode` / `regen.cuda_graphs` pick its decode loop."""
    from pipeline.regen.generator import Sampling
    from pipeline.regen.hf import HFGenerator
    from pipeline.target import load_target

    model = load_target(target.location, cfg.target)
    tok = target.tokenizer
    return HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=prefix.stop_ids,
                       sampling=Sampling(s.temperature, s.top_p, s.top_k), batch_size=s.batch_size,
                       decode=cfg.regen.hf_decode, cuda_graphs=cfg.regen.cuda_graphs)


def _write_unit(out: StageDir, unit: str, path: Path, first: int, outs, tokenizer, s: SynthesizeConfig,
                markers: list[str], seen: set[str], room: int) -> dict:
    """Judge a unit's generations, keep at most `room` new prompts, write the unit file and its sidecar."""
    counts: Counter = Counter()
    examples: dict[str, list] = {}
    kept, fresh = [], set()
    for j, g in enumerate(outs):
        ids = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        counts["attempts"] += 1
        reason = judge(text, g.finish_reason, s, markers)
        if reason is None:
            key = normalize(text)
            if key in seen or key in fresh:
                reason = "duplicate"
            elif len(kept) >= room:
                counts["not_needed"] += 1
                continue
            else:
                fresh.add(key)
                kept.append({"prompt": text.strip(), "attempt": first + j})
                continue
        counts[reason] += 1
        bucket = examples.setdefault(reason, [])
        if len(bucket) < EXAMPLES_PER_REASON:
            bucket.append({"attempt": first + j, "excerpt": text[:EXCERPT_CHARS]})
    counts["kept"] = len(kept)
    with AtomicFile(path) as tmp:
        Path(tmp).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    return out.finish_unit(unit, [path], counts=dict(counts), examples=examples)
