"""``/ui`` in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
scripts/ensure_chromium.sh) driven by Selenium, against a real router and emulated workers.

The page loads with no console errors, a request sent to the router appears on it within a
second, the breakdown draws one bar group per worker with the chosen one marked, and a
screenshot is written under the test's output (``KVROUTE_UI_SCREENSHOT`` copies it elsewhere,
e.g. to docs/figures/ui.png).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim.local_cluster import LocalCluster, free_port, wait_healthy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
TOKEN = "ui-test-admin-token-0123456789"
WORKERS = 3
SYSTEM = "You are the support assistant of a GPU cloud. Answer briefly and cite the handbook. "

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (scripts/ensure_chromium.sh "
        "installs them)",
    ),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Emulated workers and ``kvroute serve`` with an admin token (in the environment)."""
    logs = tmp_path_factory.mktemp("ui-logs")
    with LocalCluster(workers=WORKERS, time_scale=10.0, log_dir=str(logs)) as cluster:
        cluster.start_workers()
        port = free_port()
        env = {
            **os.environ,
            "KVROUTE_ADMIN_TOKEN": TOKEN,
            "KVROUTE_CONTROL_PORT": str(free_port()),
        }
        args = [sys.executable, "-m", "kvroute", "serve", "--port", str(port), "--time-scale"]
        with open(logs / "router.log", "wb") as log:
            proc = subprocess.Popen(
                [*args, "10", "--worker-urls", *cluster.worker_urls],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, 60, proc)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def send(url: str, prompt: str, max_new_tokens: int = 8) -> str:
    """One request through the router; its decision id."""
    body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
    req = urllib.request.Request(
        url + "/generate", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        return str(resp.headers["X-KVRoute-Decision-Id"])


def traffic(url: str, n: int) -> None:
    """A few shared-prefix groups, so the charts and the breakdown have something to show."""
    threads = [
        threading.Thread(target=send, args=(url, f"{SYSTEM * (1 + i % 3)} topic {i % 4} q{i}"))
        for i in range(n)
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()


def busy(url: str, requests: int) -> None:
    """The paper's GSP workload through ``kvroute bench``: groups of prompts sharing
    prefixes, token ids, a minute of arrivals at a load where queues build up."""
    subprocess.run(
        [sys.executable, "-m", "kvroute", "bench", "--url", url, "--time-scale", "10",
         "--workload", "gsp", "--gsp-groups", "24", "--gsp-prompts-per-group", str(requests // 24),
         "--rate", "1.6", "--output-len", "64", "--no-progress"],
        check=True, capture_output=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="kvroute-ui-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1440,1080",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(check: Any, timeout_s: float, every_s: float = 0.02) -> float:
    """Poll ``check()`` until truthy; the seconds it took (fails after ``timeout_s``)."""
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {check.__doc__ or check}")
        time.sleep(every_s)
    return time.perf_counter() - started


# What the breakdown panel shows, read in one go inside the page.
BREAKDOWN = """
return {
  title: document.getElementById("breakdown-title").textContent,
  groups: [...document.querySelectorAll("#groups .worker-group")].map((g) => ({
    worker: g.dataset.worker,
    chosen: g.classList.contains("chosen"),
    labels: [...g.querySelectorAll(".bar-row .label")].map((e) => e.textContent),
    cost_width_px: g.querySelector(".bar.cost").getBoundingClientRect().width,
  })),
};
"""


def row_ids(driver: Any) -> list[str]:
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll('#decision-rows tr')].map(r => r.dataset.id)"
        )
    )


def test_the_page_shows_each_decision_live_with_its_breakdown(
    router: str, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    traffic(router, 12)  # history before the page opens
    browser.get(router + "/ui")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "token-form").submit()

    def live() -> bool:
        """the page is connected as admin and shows the policy"""
        access = browser.find_element(By.ID, "access").text
        state = browser.find_element(By.ID, "connection").text
        return state == "live" and access.startswith("admin") and bool(row_ids(browser))

    wait_for(live, 15)
    assert browser.find_element(By.ID, "policy").text == "lbgr"
    assert browser.find_element(By.ID, "model").text.startswith("ratio v")

    # A request sent now appears on the page within a second (routing time, not its answer).
    before = set(row_ids(browser))
    answer: dict[str, str] = {}
    sender = threading.Thread(
        target=lambda: answer.update(id=send(router, SYSTEM + " the request to watch", 64))
    )
    started = time.perf_counter()
    sender.start()

    def appeared() -> bool:
        """a new decision row"""
        return bool(set(row_ids(browser)) - before)

    wait_for(appeared, 5)
    seen_after = time.perf_counter() - started
    sender.join()
    assert seen_after < 1.0, f"the decision took {seen_after:.2f} s to appear"
    assert answer["id"] in row_ids(browser)

    # Its breakdown: one bar group per worker, the chosen one marked, every bar drawn. The page
    # redraws on every event, so each look is one script run inside it (no stale elements).
    browser.execute_script(
        "document.querySelector(`#decision-rows tr[data-id='${arguments[0]}']`).click()",
        answer["id"],
    )
    drawn = browser.execute_script(BREAKDOWN)
    assert drawn["title"].startswith(answer["id"][:10])
    assert len(drawn["groups"]) == WORKERS
    chosen = [g["worker"] for g in drawn["groups"] if g["chosen"]]
    assert len(chosen) == 1
    assert drawn["title"].endswith("-> " + chosen[0])
    for group in drawn["groups"]:
        assert group["labels"] == [
            "cached",
            "base",
            "queue",
            "residual",
            "predicted",
            "impact",
            "cost",
        ]
        assert group["cost_width_px"] > 0

    # The charts have one line per worker, over the seconds with traffic.
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#chart-flight polyline")) > 0, 5)
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#chart-hit polyline")) > 0, 5)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart-hit polyline")) <= WORKERS

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

    target = os.environ.get("KVROUTE_UI_SCREENSHOT")
    if target:  # a figure for the docs: a minute of mixed traffic, so the charts have lines
        busy(router, 960)
        time.sleep(1.5)
    shot = tmp_path / "ui.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")
    if target:
        shutil.copyfile(shot, target)


def test_without_the_token_the_page_shows_labels_and_no_figures(router: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(router + "/ui")
    browser.execute_script("sessionStorage.clear()")
    browser.get(router + "/ui")
    wait_for(lambda: browser.find_element(By.ID, "connection").text == "live", 15)
    send(router, SYSTEM + " seen without the token")
    wait_for(lambda: len(browser.execute_script(BREAKDOWN)["groups"]) > 0, 5)
    names = [g["worker"] for g in browser.execute_script(BREAKDOWN)["groups"]]
    assert len(names) == WORKERS
    assert not any(name.startswith("http") for name in names)  # labels: w0, w1, ...
    values = browser.execute_script(
        "return [...document.querySelectorAll('#groups .value')].map((e) => e.textContent)"
    )
    assert set(values) == {"-"}
    assert "without the admin token" in browser.find_element(By.ID, "access").text
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
