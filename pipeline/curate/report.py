"""stats.json and report.md of a curation run: counts per source (and per category), where each source's data
came from (or why it is absent), what a synthesizing target wrote and dropped, drops per reason with examples,
parse failures with their file:line, the mixture, and length histograms as text."""

from __future__ import annotations

import numpy as np

from pipeline.curate.clean import DROP_REASONS

CHAR_EDGES = [0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
BAR = 40


def histogram(values: np.ndarray, edges: list[int]) -> dict:
    """{"edges": [...], "counts": [...]}: counts[i] = #values in [edges[i], edges[i+1]), the last bucket open."""
    idx = np.searchsorted(np.asarray(edges), np.asarray(values), side="right") - 1
    counts = np.bincount(np.clip(idx, 0, len(edges) - 1), minlength=len(edges)) if len(values) else np.zeros(len(edges))
    return {"edges": list(edges), "counts": [int(c) for c in counts]}


def histogram_text(h: dict, unit: str = "") -> str:
    edges, counts = h["edges"], h["counts"]
    top = max(counts) if counts and max(counts) else 1
    total = sum(counts) or 1
    lines = []
    for i, c in enumerate(counts):
        label = f"{edges[i]:>6}-{edges[i + 1] - 1:<6}" if i + 1 < len(edges) else f"{edges[i]:>6}+      "
        lines.append(f"{label}{unit} {c:>9}  {100 * c / total:5.1f}%  {'#' * round(BAR * c / top)}")
    return "\n".join(lines)


def length_summary(values: np.ndarray) -> dict:
    if not len(values):
        return {"n": 0}
    q = np.percentile(values, [50, 90, 99])
    return {"n": int(len(values)), "mean": round(float(np.mean(values)), 1), "p50": int(q[0]), "p90": int(q[1]),
            "p99": int(q[2]), "max": int(np.max(values))}


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", "\\n")


def _checksum_text(checksum: dict) -> str:
    if "sha256" in checksum:
        return ", ".join(f"sha256 {d[:16]}… ({name.rsplit('/', 1)[-1]})" for name, d in checksum["sha256"].items())
    return ", ".join(f"{k} {v}" for k, v in checksum.items())


def render_report(stats: dict) -> str:
    """The human-readable report.md from stats.json's content."""
    c = stats["counts"]
    out = [f"# Curation report: {stats['run']}", ""]
    dropped = sum(v for k, v in c.items() if k.startswith("dropped."))
    out += [
        f"{c['train']} train + {c['eval']} eval conversations from {c['read']} raw records "
        f"({c['malformed']} malformed, {c['conversations']} conversations, {dropped} dropped, "
        f"{c['unique']} unique; {c['repeats']} up-sampled copies, {c['not_selected']} left out by down-sampling).",
        "",
        f"Output: `{stats['output']}` ({stats['shards']['train']} train + {stats['shards']['eval']} eval parquet shards).",
        "",
        "## Sources",
        "",
        "| source | dataset | formats | read | malformed | dropped | unique | eval | train (distinct + copies) "
        "| weight | share | up/down-sampling |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in stats["sources"].items():
        fmts = ", ".join(f"{k} {v}" for k, v in sorted(s["formats"].items())) or "-"
        if s["target"] > s["available"]:
            how = f"up x{s['factor']:.2f}"
        elif s["target"] < s["available"]:
            how = f"down x{s['factor']:.2f}"
        else:
            how = "all"
        dataset = f"`{_cell(s['path'])}`" if s.get("status", "used") == "used" else s["status"]
        out.append(
            f"| {name} | {dataset} | {fmts} | {s['read']} | {s['malformed']} | {sum(s['dropped'].values())} "
            f"| {s['unique']} | {s['eval']} | {s['train']} ({s['selected_unique']} + {s['repeats']}) "
            f"| {s['weight']:g} | {100 * s['share']:.1f}% | {how} |"
        )
    if stats.get("categories"):
        out += ["", "| category | read | unique | eval | train (distinct) |", "|---|---:|---:|---:|---:|"]
        for name, k in stats["categories"].items():
            out.append(f"| {name} | {k['read']} | {k['unique']} | {k['eval']} | {k['train']} ({k['selected_unique']}) |")
    out += ["", "## Where the data came from", "",
            "| source | status | from | identity | checksum / reason |", "|---|---|---|---|---|"]
    for name, d in stats.get("data", {}).items():
        what = d.get("reason") or _checksum_text(d.get("checksum") or {}) or "-"
        out.append(f"| {name} | {d['status']} | {d.get('where', '-')} | `{_cell(d.get('identity', '-'))}` | "
                   f"{_cell(what)} |")
    for name, d in stats.get("data", {}).items():
        syn = d.get("synthesized")
        if not syn:
            continue
        out += ["", f"### {name}: prompts the target wrote ({syn['kept']} kept of {syn['attempts']} attempts, "
                    f"{syn['wanted']} wanted)", "",
                f"User prefix given to the target: `{_cell(syn['prefix'])}`; its turn ends at "
                f"`{_cell(syn['end_of_turn'] or 'EOS')}`.", "",
                "| dropped because | count |", "|---|---:|"]
        out += [f"| {reason} | {n} |" for reason, n in syn["dropped"].items()]
        for reason, ex in syn["examples"].items():
            out += ["", f"{reason}:", "", "```"] + [f"attempt {e['attempt']}: {e['excerpt']!r}" for e in ex] + ["```"]
    out += ["", "## Drops by reason", "",
            "| reason | " + " | ".join(stats["sources"]) + " | total |",
            "|---|" + "---:|" * (len(stats["sources"]) + 1)]
    for reason in DROP_REASONS:
        per = [s["dropped"].get(reason, 0) for s in stats["sources"].values()]
        out.append(f"| {reason} | " + " | ".join(map(str, per)) + f" | {sum(per)} |")
    for reason in DROP_REASONS:
        ex = stats["drops"].get(reason, {}).get("examples", [])
        if not ex:
            continue
        out += ["", f"### {reason} ({stats['drops'][reason]['count']})", "", "```"]
        for e in ex:
            where = e.get("location") or ""
            what = e.get("detail") or (f"duplicate of {e['duplicate_of']}" if "duplicate_of" in e else "")
            out.append(f"{e['id']}  {where}  {what}")
            out.append(f"    {e.get('excerpt', '')!r}")
        out.append("```")
    m = stats["malformed"]
    out += ["", f"## Malformed records ({m['count']}, rate {m['rate']:.4%}, limit {m['max_error_rate']:.2%})", ""]
    if m["examples"]:
        out += ["```"] + [f"{e['location']}: {e['error']}" for e in m["examples"]] + ["```"]
    else:
        out.append("none")
    if stats["fixes"]:
        out += ["", "## Fixes (kept, changed)", ""] + [f"- {k}: {v}" for k, v in stats["fixes"].items()]
    out += ["", "## Lengths", "",
            "| split | conversations | mean chars | p50 | p90 | p99 | max |", "|---|---:|---:|---:|---:|---:|---:|"]
    for split in ("train", "eval"):
        for what, key in (("", "summary"), (" (prompt side)", "prompt_summary")):
            s = stats["lengths"][split][key]
            if s["n"]:
                out.append(f"| {split}{what} | {s['n']} | {s['mean']} | {s['p50']} | {s['p90']} | {s['p99']} | {s['max']} |")
    for split in ("train", "eval"):
        out += ["", f"Characters per conversation ({split}):", "", "```",
                histogram_text(stats["lengths"][split]["chars"]), "```"]
    out += ["", "Turns per conversation (train):", "", "```", histogram_text(stats["lengths"]["train"]["turns"]), "```"]
    d = stats["dedup"]
    out += ["", "## Dedup", "",
            f"- key: {d['key']}",
            f"- exact: blake2b-128 of the normalized key text; first occurrence kept (sources in config order)",
            f"- near: {'on' if d['near'] else 'off'}; MinHash {d['num_perm']} permutations over word "
            f"{d['shingle_words']}-grams, datasketch MinHashLSH (b={d['bands']}, r={d['rows']}), "
            f"candidates confirmed at estimated Jaccard >= {d['threshold']}",
            "", "## Timings (this invocation)", "", "| phase | seconds |", "|---|---:|"]
    out += [f"| {k} | {v:.2f} |" for k, v in stats["timings"].items()]
    return "\n".join(out) + "\n"
