"""The documentation site as a user meets it: built with ``mkdocs build --strict`` (a broken link or
reference fails), served on localhost and opened in headless Chromium, whose rendered page and
screenshot are checked for the home page and the benchmarks page; every relative link of the
README resolves."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    config = os.path.join(ROOT, "docs", "config", "mkdocs.yml")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_site_has_every_page_and_the_api_from_the_docstrings(site):
    for page in ("index.html", "quickstart/index.html", "concepts/index.html", "trainers/index.html",
                 "ppo/index.html", "sft/index.html", "dpo/index.html", "multi_gpu/index.html", "pays/index.html", "reference/index.html",
                 "benchmarks/index.html", "faq/index.html", "limitations/index.html"):
        assert (site / page).is_file(), page
    reference = (site / "reference" / "index.html").read_text()
    assert 'id="trl_tree.engine.api.tree_logprobs"' in reference
    assert "computing each shared token once" in reference  # tree_logprobs' docstring, rendered
    for figure in ("forest", "visibility", "walk", "gradients"):
        assert (site / "figures" / f"{figure}.png").is_file()


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def chromium(*args: str) -> subprocess.CompletedProcess:
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no Chromium on this machine (.ci/run installs Debian's)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--hide-scrollbars"]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("page,expected", [
    ("", ["never computing a shared token twice", "What gets faster", "tree/dedup_ratio"]),
    ("benchmarks/", ["Accumulation windows", "W1", "Karmarkar"]),
])
def test_pages_render_in_a_headless_browser(served, tmp_path, page, expected):
    url = f"{served}/{page}"
    dom = chromium(f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom.stdout))
    for phrase in expected:
        assert phrase in text, f"{phrase!r} not on the rendered page {url}"
    shot = tmp_path / "shot.png"
    done = chromium(f"--user-data-dir={tmp_path / 'profile-shot'}", "--window-size=1280,900",
                    f"--screenshot={shot}", url)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1280, 900)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is (nearly) blank"


def test_readme_links_resolve():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert os.path.exists(os.path.join(ROOT, target)), f"README links to a missing {target}"
