"""report.html opened in a real headless browser (Debian's chromium-headless-shell; `make browser` installs it):
the page parses, opens with the verdict, every embedded plot decodes to a picture, and the tables render."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_report_files import make_report  # noqa: E402

from eval.report import write_report  # noqa: E402

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium on PATH (`make browser` installs "
                                                        "Debian's chromium-headless-shell)")

# appended to a COPY of the report (the report itself has no script): what the browser made of the page
PROBE = """<script>window.addEventListener('load', () => {
  const out = {images: [...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight]),
               h2: [...document.querySelectorAll('h2')].map(h => h.textContent),
               first: document.querySelector('h2 + p').textContent,
               tables: [...document.querySelectorAll('table')].map(t => t.rows.length),
               width: document.documentElement.scrollWidth};
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});</script>"""


def browse(page: Path, *args: str) -> str:
    run = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          *args, page.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_report_html_renders_in_a_browser_verdict_first_every_plot_decoded(tmp_path):
    report = make_report("run-browser", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]])
    for c in report["cells"]:
        c["responses"] = 12  # enough to choose a best method
    write_report(report, tmp_path)
    probe = tmp_path / "probe.html"
    probe.write_text((tmp_path / "report.html").read_text().replace("</body>", PROBE + "</body>"))
    dom = browse(probe, "--dump-dom")
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, flags=re.S)
    assert found, dom[-2000:]
    seen = json.loads(html.unescape(found.group(1)))
    assert seen["h2"][0] == "Verdict" and seen["first"].startswith("Best method: ddtree@16")
    assert len(seen["images"]) == 5 and all(done and w > 100 and h > 100 for done, w, h in seen["images"])
    assert len(seen["tables"]) == 8 and all(rows >= 2 for rows in seen["tables"])  # the verdict's per benchmark first
    assert seen["width"] <= 1400  # no table or plot pushes the page sideways
    shot = tmp_path / "report.png"
    browse(tmp_path / "report.html", f"--screenshot={shot}", "--window-size=1200,2400")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
