"""Headless Chromium for the browser tests: Debian's chromium and chromium-driver (``make browser``), driven by
Selenium through that chromedriver (so Selenium Manager never goes to the network)."""
from __future__ import annotations

import os
import shutil
import tempfile

CHROMIUM = os.environ.get("CHAINSWARM_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHAINSWARM_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1300")


def missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (requirements-dev.txt)"
    absent = [path for path in (CHROMIUM, CHROMEDRIVER) if not (os.path.exists(path) and os.access(path, os.X_OK))]
    if absent:
        return f"{' and '.join(absent)} not installed (run `make browser`: apt-get install chromium chromium-driver)"
    return None


class Browser:
    """One headless Chromium with a fresh profile; ``console_errors()`` reads (and clears) its console log."""

    def __init__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="chainswarm-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        self.driver.set_script_timeout(30)

    def console(self) -> list[dict]:
        return self.driver.get_log("browser")

    def console_errors(self, allowed: tuple[str, ...] = ()) -> list[str]:
        """Console messages of level WARNING or worse since the last call, minus those containing ``allowed``."""
        return [e["message"] for e in self.console() if e["level"] in ("SEVERE", "WARNING")
                and not any(a in e["message"] for a in allowed)]

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
