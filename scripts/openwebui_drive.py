"""Drive one chat in Open WebUI through headless Chromium (Playwright): open the page, send a message to the model
served by `exl2cpp serve`, watch the answer grow while it streams, and save a screenshot. Used by
scripts/openwebui_check.sh, which starts both servers; prints one JSON line of what it saw and exits non-zero when
no streamed answer appeared.
    python scripts/openwebui_drive.py URL OUT_DIR [--chromium PATH] [--message TEXT] [--timeout S]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ANSWER = '[id^="response-content-container"], .chat-assistant'  # an assistant message (Open WebUI 0.5 - 0.12)
INPUT = "#chat-input"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out", type=Path)
    ap.add_argument("--chromium", default=None, help="a Chromium binary (default: Playwright's own, if installed)")
    ap.add_argument("--message", default="What is the capital of France?")
    ap.add_argument("--timeout", type=float, default=180.0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    seen: dict = {"url": a.url, "message": a.message}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=a.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        t0 = time.time()
        page.goto(a.url, wait_until="domcontentloaded", timeout=a.timeout * 1000)
        page.wait_for_selector(INPUT, timeout=a.timeout * 1000)
        seen["page_ready_s"] = round(time.time() - t0, 1)
        page.keyboard.press("Escape")  # a "what's new" dialog, if any
        page.click(INPUT)
        page.keyboard.type(a.message)
        page.screenshot(path=str(a.out / "openwebui_before.png"))
        t1 = time.time()
        page.keyboard.press("Enter")
        lengths: list[int] = []  # the answer's length at each poll: several values = it streamed
        text, last_change, first = "", time.time(), None
        while time.time() - t1 < a.timeout:
            els = page.query_selector_all(ANSWER)
            now = els[-1].inner_text().strip() if els else ""
            if now != text:
                text, last_change = now, time.time()
                lengths.append(len(now))
                first = first if first is not None or not now else last_change
            elif text and time.time() - last_change > 5:  # no change for 5 s: done
                break
            time.sleep(0.05)
        seen.update(
            answer=text,
            answer_lengths_seen=lengths,
            first_text_s=None if first is None else round(first - t1, 1),
            answer_s=round(last_change - t1, 1),
            streamed=len([n for n in lengths if n > 0]) >= 3,
        )
        page.screenshot(path=str(a.out / "openwebui_answer.png"), full_page=True)
        browser.close()
    print(json.dumps(seen))
    return 0 if seen["streamed"] and text else 1


if __name__ == "__main__":
    sys.exit(main())
