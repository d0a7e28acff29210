"""The dashboard in a real browser: headless Chromium (Debian's chromium + chromium-driver,
through selenium) against a real coordinator (``--http-login``, so the page asks for a join
token as it does beyond loopback), two real agents and jobs of two tenants submitted with the
``epochmesh`` CLI.

The submitter, logged in with the CLI, opens the URL `epochmesh dashboard` prints (logged in as
itself, no join token of its own), sees both agents and its own job but nothing of the other
tenant's job (not in the list, not on a node, its page a 404), watches the loss chart gain
points as rounds land, and no page logs a console error. The job page's screenshot is saved
(to ``$EPOCHMESH_SCREENSHOT_DIR`` when set, which is how docs/dashboard-job.png is made).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import write_mlp_job
from tests.procs import start_coordinator, wait_until
from tests.system.test_cli_support import (
    AgentProc,
    Cli,
    engine_available,
)

pytestmark = pytest.mark.timeout(180)
log = logging.getLogger(__name__)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _browser_available() -> bool:
    if CHROMIUM is None or CHROMEDRIVER is None:
        return False
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    if not _browser_available():
        pytest.skip("headless Chromium, chromedriver or selenium missing (scripts/test.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    assert CHROMIUM is not None
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


def _console_errors(driver: object) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[attr-defined]


def _submit(cli: Cli, root: Path, name: str, epochs: int, priority: str) -> str:
    job = write_mlp_job(
        root / name,
        num_samples=256,
        overrides={"name": name, "train": {"epochs": epochs}, "cluster": {"priority": priority}},
    )
    result = cli.run("submit", str(job), "--output", "json", timeout=120)
    assert result.code == 0, result.stderr
    job_id = result.json()["job_id"]
    assert isinstance(job_id, str)
    return job_id


def test_dashboard_in_headless_chromium(tmp_path: Path, browser: object) -> None:
    if not engine_available():
        pytest.skip("coordinator without training engine")
    from selenium.webdriver.common.by import By

    driver = browser
    started = time.monotonic()
    root = tmp_path
    coord = start_coordinator(
        root / "coord",
        "--heartbeat-interval",
        "0.5",
        "--http-listen",
        "127.0.0.1:0",
        "--http-login",
    )
    agents: list[AgentProc] = []
    try:
        log.info("coordinator up after %.1fs", time.monotonic() - started)
        http = (root / "coord" / "http.addr").read_text().strip()
        base = f"http://{http}"
        for name in ("alpha", "beta"):
            agents.append(
                AgentProc(
                    coord.address,
                    root / name,
                    name,
                    "--slowdown",
                    "3",
                    "--metrics-listen",
                    "127.0.0.1:0",
                )
            )
        other = Cli(coord.address, root / "tenant-b", role="submitter")
        other_job = _submit(other, root, "other-tenants-job", epochs=1, priority="low")
        timings = {"other submitted": time.monotonic() - started}

        # A submitter logged in with the CLI submits a job, then opens the dashboard as itself
        # with the URL `epochmesh dashboard` prints (a one-time code signed with its key; the
        # login page takes it from the URL's fragment).
        mine = Cli(coord.address, root / "tenant-a", role="submitter")
        job_id = _submit(mine, root, "dashboard-demo", epochs=200, priority="high")
        me = mine.run("whoami", "--output", "json").json()["principal"]
        link = mine.run("dashboard", "--url", base, "--output", "json")
        assert link.code == 0, link.stderr
        driver.get(link.json()["url"])  # type: ignore[attr-defined]

        def whoami() -> str:
            found = driver.find_elements(By.CSS_SELECTOR, "#whoami[data-principal]")  # type: ignore[attr-defined]
            return found[0].get_attribute("data-principal") if found else ""

        principal = str(wait_until(whoami, timeout=20, message="no login"))
        assert principal == me, (principal, me)
        timings["logged in"] = time.monotonic() - started
        driver.get_log("browser")  # type: ignore[attr-defined]  # the 401 of the login page
        timings["submitted"] = time.monotonic() - started
        # The job page: the loss chart gains points as rounds land.
        driver.get(f"{base}/jobs/{job_id}")  # type: ignore[attr-defined]

        def points() -> int:
            chart = driver.find_element(By.ID, "loss-chart")  # type: ignore[attr-defined]
            return int(chart.get_attribute("data-points") or 0)

        def page_state() -> str:
            status = driver.find_element(By.ID, "status").text  # type: ignore[attr-defined]
            facts = driver.find_element(By.ID, "job-facts").text  # type: ignore[attr-defined]
            return f"points {points()}, status {status!r}, job {facts!r}, console " + repr(
                driver.get_log("browser")  # type: ignore[attr-defined]
            )

        timings["job page"] = time.monotonic() - started
        first = int(wait_until(points, timeout=40, interval=0.2, message="no round on the chart"))
        try:
            wait_until(lambda: points() > first, timeout=20, interval=0.2)
        except TimeoutError:
            raise AssertionError(
                f"the loss chart stays at {first} points: {page_state()}"
            ) from None
        rows = driver.find_elements(By.CSS_SELECTOR, "#job-nodes tbody tr")  # type: ignore[attr-defined]
        assert rows, "no node on the job page"
        wait_until(lambda: points() >= 8, timeout=30, interval=0.2)
        shots = Path(os.environ.get("EPOCHMESH_SCREENSHOT_DIR") or root)
        shots.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(shots / "dashboard-job.png"))  # type: ignore[attr-defined]
        assert not _console_errors(driver), _console_errors(driver)

        timings["chart"] = time.monotonic() - started
        driver.get(base + "/")  # type: ignore[attr-defined]

        def overview_shows() -> bool:
            nodes = driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")  # type: ignore[attr-defined]
            jobs = driver.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")  # type: ignore[attr-defined]
            names = {n.find_element(By.CSS_SELECTOR, "td").text for n in nodes}
            ids = {j.get_attribute("data-job-id") for j in jobs}
            return {"alpha", "beta"} <= names and job_id in ids

        wait_until(overview_shows, timeout=20, interval=0.2, message="overview incomplete")
        # Let the events feed and node table refresh a few times, then look for the other job.
        shown = driver.find_element(By.ID, "status").get_attribute("data-updated-ms")  # type: ignore[attr-defined]
        wait_until(
            lambda: (
                driver.find_element(By.ID, "status").get_attribute("data-updated-ms")  # type: ignore[attr-defined]
                != shown
            ),
            timeout=10,
            interval=0.1,
        )
        source = driver.page_source  # type: ignore[attr-defined]
        assert other_job not in source and "other-tenants-job" not in source
        assert not _console_errors(driver), _console_errors(driver)

        # Another tenant's job page is a 404 for this submitter.
        driver.get(f"{base}/jobs/{other_job}")  # type: ignore[attr-defined]
        assert "404" in driver.title  # type: ignore[attr-defined]
        # Each agent's own metrics: the steps and samples it trained, its cache, its memory.
        for agent in agents:
            addr = (root / agent.name / "metrics.addr").read_text().strip()
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            assert 'epochmesh_agent_tasks_total{kind="train",outcome="ok"}' in text, text[-2000:]
            assert _value(text, "epochmesh_agent_samples_total") > 0
            assert _value(text, "epochmesh_agent_steps_total") > 0
            assert _value(text, "epochmesh_agent_cache_bytes") > 0
            assert _value(text, "epochmesh_agent_memory_rss_bytes") > 0
            push = (
                'epochmesh_agent_sent_bytes_total{method="/epochmesh.v1.AgentService/PushUpdate"}'
            )
            assert push in text
        timings["total"] = time.monotonic() - started
        log.info("dashboard browser test: seconds since start %s", timings)
        assert timings["total"] < 150, timings
    finally:
        for agent in agents:
            agent.stop()
        coord.kill9()
