"""Benchmark of `drafter curate` at production scale on synthetic data.

Generates ~n synthetic conversations in three local sources (OpenAI jsonl, ShareGPT jsonl, Alpaca
parquet) with planted exact/near duplicates, malformed lines and defects
(`pipeline.curate.synthetic`), runs the real curate stage on them with `curate.total` (913000 at the
default n = 1M) and prints a table: wall time per phase, total, peak RSS, rows/s, and what dedup found
against what was planted.

    .venv/bin/python benchmarks/bench_curate.py                  # 1M records, total 913000
    .venv/bin/python benchmarks/bench_curate.py --n 50000        # a quick run
    .venv/bin/python benchmarks/bench_curate.py --workers 1      # one process

curate is CPU-only (no GPU phase); `--device` is accepted for symmetry with the other benchmarks and
must be 'cpu'. Generated data is kept under --out and reused when n and seed match.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.curate.stage import run_curate  # noqa: E402
from pipeline.curate.synthetic import write_synthetic  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="synthetic raw records to generate")
    p.add_argument("--total", type=int, default=None, help="curate.total (default: 0.913 * n)")
    p.add_argument("--eval-size", type=int, default=None, help="curate.eval_size (default: n / 500)")
    p.add_argument("--workers", type=int, default=0, help="curate.num_workers (0 = one per core)")
    p.add_argument("--read-chunk", type=int, default=20000, help="curate.read_chunk")
    p.add_argument("--shard-size", type=int, default=50000, help="curate.shard_size")
    p.add_argument("--no-near-dedup", action="store_true", help="exact dedup only")
    p.add_argument("--seed", type=int, default=0, help="data generation seed")
    p.add_argument("--out", default="/tmp/bench_curate", help="where data and the run go")
    p.add_argument("--device", default="cpu", choices=["cpu"], help="curate has no GPU phase")
    return p.parse_args()


def generate(data_dir: Path, n: int, seed: int) -> tuple[dict, float]:
    stamp = data_dir / "synthetic.json"
    if stamp.exists():
        info = json.loads(stamp.read_text())
        if info["records"] == n and info.get("seed") == seed:
            return info, 0.0
    shutil.rmtree(data_dir, ignore_errors=True)
    t = time.time()
    info = write_synthetic(data_dir, n, seed=seed)
    info["seed"] = seed
    stamp.write_text(json.dumps(info))
    return info, time.time() - t


class RssSampler(threading.Thread):
    """Samples VmRSS of this process and of its descendants (the curate workers) every 0.2 s.

    ru_maxrss cannot be used for spawned workers: it includes the parent's pages at fork time."""

    def __init__(self):
        super().__init__(daemon=True)
        self.main = self.main_anon = self.worker = self.together = 0
        self.stop = threading.Event()

    @staticmethod
    def _rss_kib(pid: int, field: str = "VmRSS:") -> int:
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith(field):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _descendants(self, root: int) -> list[int]:
        parent = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        out, frontier = [], [root]
        while frontier:
            kids = [p for p, pp in parent.items() if pp in frontier]
            out += kids
            frontier = kids
        return out

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.2):
            main = self._rss_kib(me)
            workers = [self._rss_kib(p) for p in self._descendants(me)]
            self.main = max(self.main, main)
            self.main_anon = max(self.main_anon, self._rss_kib(me, "RssAnon:"))
            self.worker = max([self.worker, *workers])
            self.together = max(self.together, main + sum(workers))


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # keeps generation out of this process's memory
        data, gen_seconds = pool.apply(generate, (out / f"data-{args.n}", args.n, args.seed))
    total = args.total if args.total is not None else round(args.n * 0.913)
    eval_size = args.eval_size if args.eval_size is not None else max(1, args.n // 500)
    cfg_data = {
        "name": f"bench-{args.n}", "runs_dir": str(out / "runs"), "seed": 0,
        "curate": {"sources": data["sources"], "total": total, "eval_size": eval_size,
                   "num_workers": args.workers, "read_chunk": args.read_chunk, "shard_size": args.shard_size,
                   "near_dedup": not args.no_near_dedup},
    }
    cfg_path = out / "bench.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_data))
    cfg = load_config(cfg_path)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)

    sampler = RssSampler()
    sampler.start()
    load_before = os.getloadavg()
    t, cpu = time.time(), cpu_seconds()
    manifest = run_curate(cfg, force=True)
    wall, cpu = time.time() - t, cpu_seconds() - cpu
    sampler.stop.set()
    load_after = os.getloadavg()
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    c = stats["counts"]
    timings = stats["timings"]

    rows = [("generate data (not part of curate)", gen_seconds, args.n)]
    rows_of = {"plan": c["read"], "read": c["read"], "dedup": c["conversations"], "select": c["unique"],
               "write": c["train"] + c["eval"]}
    rows += [(f"curate: {k}", timings[k], n) for k, n in rows_of.items()]
    rows.append(("curate: total (run_curate wall)", wall, c["read"]))
    print()
    print(f"curate benchmark: n={args.n} records, total={total}, eval_size={eval_size}, workers={args.workers or os.cpu_count()}, "
          f"near_dedup={not args.no_near_dedup}, machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM")
    print(f"{'phase':40s} {'seconds':>9s} {'rows':>10s} {'rows/s':>10s}")
    for name, sec, n in rows:
        rate = f"{n / sec:10.0f}" if sec > 0 else f"{'-':>10s}"
        print(f"{name:40s} {sec:9.1f} {n:10d} {rate}")
    print(f"{'CPU seconds, main + workers':40s} {cpu:9.1f}")
    print(f"{'peak RSS, main process (ru_maxrss)':40s} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:9.0f} MiB")
    print(f"{'peak RSS, main process (sampled)':40s} {sampler.main / 1024:9.0f} MiB")
    print(f"{'  of which anonymous (not mmapped files)':40s} {sampler.main_anon / 1024:9.0f} MiB")
    print(f"{'peak RSS, largest worker (sampled)':40s} {sampler.worker / 1024:9.0f} MiB")
    print(f"{'peak RSS, all processes (sampled)':40s} {sampler.together / 1024:9.0f} MiB")
    print(f"load average before/after (other users of the machine): {load_before[0]:.1f} / {load_after[0]:.1f}")
    planted = data["planted"]
    print(f"read {c['read']}, malformed {c['malformed']} (planted {planted['malformed']}), "
          f"exact dups {c['dropped.exact_duplicate']} (planted {planted['exact']}), "
          f"near dups {c['dropped.near_duplicate']} (planted {planted['near']}), "
          f"other drops {sum(v for k, v in c.items() if k.startswith('dropped.') and 'duplicate' not in k)} "
          f"(planted {planted['defect']})")
    print(f"output: {c['train']} train + {c['eval']} eval rows in {manifest['num_units']} shards, "
          f"{manifest['total_bytes'] / 2**20:.0f} MiB; report: {cfg.run_dir / 'curate' / 'report.md'}")


if __name__ == "__main__":
    main()
