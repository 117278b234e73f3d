"""Render a ``resilient-ckpt report`` HTML page in headless Chromium and save a PNG of it.

    python scripts/screenshot_report.py report.html report_browser.png [--width 1400]
        [--browser /usr/bin/chromium]

Needs a Chromium (Debian/Ubuntu: ``apt-get install chromium``; any ``chromium``,
``chromium-browser``, ``google-chrome`` or ``chrome-headless-shell`` on PATH, or ``--browser`` /
``RESILIENT_BROWSER``) and Pillow (installed with matplotlib, the ``report`` extra). Not a
dependency of the package: only the slow browser test and the docs' screenshot use it.

Chromium's ``--screenshot`` captures the window, so the window is made taller than the page and
the blank below the page is cropped off. Exit code 2 when no browser is found.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome-headless-shell", "chrome")

# headless, as root, on a machine without a network: no sandbox (root), no GPU, and none of the
# background connections Chromium makes at start (refused here, many at a time)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--force-device-scale-factor=1",
)


def find_browser() -> str | None:
    """The Chromium to use: ``RESILIENT_BROWSER``, else the first of :data:`NAMES` on PATH."""
    given = os.environ.get("RESILIENT_BROWSER")
    if given:
        return given
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(
    html: str | os.PathLike[str],
    png: str | os.PathLike[str],
    *,
    width: int = 1400,
    max_height: int = 6000,
    browser: str | None = None,
    timeout: float = 120.0,
) -> tuple[int, int]:
    """Render ``html`` at ``width`` CSS pixels and write the page (cropped below its content)
    to ``png``; return the PNG's (width, height)."""
    from PIL import Image, ImageChops

    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError(
            "no Chromium found: apt-get install chromium, or give --browser / RESILIENT_BROWSER"
        )
    png = Path(png)
    with tempfile.TemporaryDirectory(prefix="rc-shot-") as tmp:
        raw = Path(tmp) / "window.png"
        cmd = [
            browser,
            *FLAGS,
            f"--user-data-dir={Path(tmp) / 'profile'}",
            f"--window-size={width},{max_height}",
            f"--screenshot={raw}",
            Path(html).resolve().as_uri(),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not raw.exists():
            raise RuntimeError(
                f"{browser} exited {p.returncode} without a screenshot: {p.stderr[-2000:]}"
            )
        img = Image.open(raw).convert("RGB")
        bg = Image.new("RGB", img.size, img.getpixel((img.width - 1, img.height - 1)))
        box = ImageChops.difference(img, bg).getbbox()
        bottom = min(img.height, (box[3] if box else img.height) + 24)
        img = img.crop((0, 0, img.width, bottom))
        png.parent.mkdir(parents=True, exist_ok=True)
        img.save(png, optimize=True)
        return img.size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--browser", default=None)
    args = ap.parse_args(argv)
    if (args.browser or find_browser()) is None:
        print("no Chromium found: apt-get install chromium (or --browser PATH)", file=sys.stderr)
        return 2
    w, h = screenshot(args.html, args.png, width=args.width, browser=args.browser)
    print(f"{args.png}: {w}x{h}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
