"""Xinference's own web UI in a real headless Chromium (issue #21): a user launches the tiny
model with two replicas and ``enable_xavier=true`` through the launch dialog of the built-in
``qwen2.5-instruct`` card, sends two requests with a shared prefix, and sees the hit in the
worker's metrics; a bad ``XAVIER_CPU_BUDGET`` shows the error toast, naming the option.

Debian's ``chromium`` (installed by ``scripts/setup.sh``) driven by Playwright for Python with
``executable_path`` (Playwright's own browser download cannot work here).  Screenshots of the
dialog, the error and the running model go to ``XAVIER_TEST_SCREENSHOTS`` (default: a temp
dir; ``doc/web-ui-*.png`` were made with it).  Without a browser the test skips, unless
``XAVIER_TEST_REQUIRE_BROWSER=1`` (CI) makes that a failure.
"""

import os
import shutil
import time
from typing import Any, Dict, List, Tuple

import pytest

from .support.xinference_server import (
    MODEL,
    Server,
    metrics_endpoint,
    wait_for_series,
)

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PASSWORD = "xavier-test-pw"
#: what the dialog's "Environment Variables" get (as in test_xinference_local's CPU launch)
ENVS = [("XAVIER_CPU_BUDGET", "64MiB"), ("XAVIER_GPU_BUDGET", "0"),
        ("VLLM_CPU_KVCACHE_SPACE", "1")]
#: what "Additional Parameters: vLLM" get: Xavier's switch and its routing (Xinference's
#: cycle, so that the two requests below go to both replicas), the CPU engine's settings
PARAMS = [("enable_xavier", "true"), ("xavier_routing", "round_robin"),
          ("tensor_parallel_size", "1"),
          ("pipeline_parallel_size", "1"), ("max_model_len", "2048"),
          ("enforce_eager", "true"), ("block_size", "16"), ("dtype", "bfloat16"),
          ("max_num_seqs", "16")]


@pytest.fixture
def browser() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is None or not os.path.exists(CHROMIUM):
        if os.environ.get("XAVIER_TEST_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium or Playwright is missing (scripts/setup.sh installs both)")
        pytest.skip("no Chromium or Playwright here")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def shots() -> str:
    path = os.environ.get("XAVIER_TEST_SCREENSHOTS") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "xavier-web-ui")
    os.makedirs(path, exist_ok=True)
    return path


def log_in(browser: Any, server: Server) -> Any:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(server.base + "/login", wait_until="networkidle")
    user, password = page.locator("input").all()[:2]
    user.fill("admin")
    password.fill(PASSWORD)
    page.get_by_role("button", name="Login").click()
    page.wait_for_selector("text=Language Models")
    return page


def pick(page: Any, field: str, value: str) -> None:
    """Choose ``value`` in the dialog's drop-down ``field``."""
    page.get_by_text(field, exact=True).last.click()
    page.get_by_text(value, exact=True).last.click()
    page.wait_for_timeout(300)


def fill_launch_dialog(page: Any, model_dir: str, envs: List[Tuple[str, str]],
                       params: List[Tuple[str, str]], shots_of_top: str = "") -> Any:
    """Open the built-in card's launch dialog and fill it as a user would; returns it
    (``shots_of_top``: a screenshot of its upper half, before the advanced part)."""
    page.get_by_placeholder("Search for model name and description").fill(MODEL)
    card = page.locator("div", has=page.get_by_text(MODEL, exact=True)).filter(
        has=page.get_by_role("button", name="Launch")).last
    card.get_by_role("button", name="Launch").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("spinbutton", name="Replica").fill("2")
    pick(page, "Model Engine", "vLLM")
    pick(page, "Model Format", "pytorch")
    pick(page, "Model Size", "0_5")
    dialog.get_by_placeholder("For PyTorch, provide the model directory", exact=False).fill(
        model_dir)
    if shots_of_top:
        dialog.screenshot(path=shots_of_top)
    dialog.get_by_text("Advanced Configuration").first.click()
    dialog.get_by_text("False", exact=True).click()  # no per-model virtualenv on CPU
    adds = dialog.get_by_role("button", name="Add", exact=True)
    # sections in order: LoRA, virtualenv packages, wheel directories, environment
    # variables, additional parameters; each Add appends a key/value row to its section
    for section, pairs in ((3, envs), (4, params)):
        for key, value in pairs:
            adds.nth(section).click()
            dialog.get_by_placeholder("key", exact=True).last.fill(key)
            dialog.get_by_placeholder("value", exact=True).last.fill(value)
    return dialog


def instances(server: Server) -> List[Dict[str, Any]]:
    return server.call("GET", f"/v1/models/instances?model_name={MODEL}&model_uid={MODEL}")


def wait_ready(server: Server, timeout: float) -> List[Dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = instances(server)
        reps = [r for i in now for r in i.get("replica_statuses") or []]
        if len(reps) == 2 and all(r["status"] == "READY" for r in reps):
            return now
        if any(r["status"] in ("ERROR", "TERMINATED") for r in reps):
            pytest.fail(f"the launch from the web UI failed: {now}")
        time.sleep(2)
    pytest.fail(f"the replicas were not ready within {timeout} s: {instances(server)}")


def test_launch_from_the_web_ui_shares_a_prefix_and_shows_errors(browser, tiny_model_dir,
                                                                 xinference_server):
    server = xinference_server
    page = log_in(browser, server)
    out = shots()

    # a bad option: the toast names it, nothing is launched
    dialog = fill_launch_dialog(page, tiny_model_dir, [("XAVIER_CPU_BUDGET", "lots")],
                                PARAMS)
    dialog.get_by_role("button", name="Deploy").click()
    toast = page.get_by_text("xavier_cpu_budget: 'lots' is not a size", exact=False)
    toast.first.wait_for(timeout=60_000)
    page.wait_for_timeout(400)  # the toast slides in
    page.screenshot(path=os.path.join(out, "web-ui-bad-budget.png"))
    assert server.call("GET", "/v1/models")["data"] == []
    assert server.engine_cores() == []

    # the launch as a user makes it: two replicas, Xavier on, options as env variables
    dialog.get_by_role("button", name="Cancel").click()
    toast.first.wait_for(state="hidden", timeout=60_000)
    dialog = fill_launch_dialog(page, tiny_model_dir, ENVS, PARAMS,
                                os.path.join(out, "web-ui-launch-dialog-top.png"))
    dialog.screenshot(path=os.path.join(out, "web-ui-launch-dialog.png"))
    dialog.get_by_role("button", name="Deploy").click()
    wait_ready(server, 900)

    # two requests sharing a prefix: Xinference's cycle (xavier_routing round_robin, set in
    # the dialog) sends them to different replicas, the second loads the first one's
    # blocks; the hit shows in the worker's metrics
    text = open(os.__file__).read()
    prefix = text[:2500]
    for i in range(2):
        usage = server.call("POST", "/v1/completions", {
            "model": MODEL, "prompt": prefix + f"\n# request {i}\n" + text[7000 + 100 * i:
                                                                          7100 + 100 * i],
            "max_tokens": 8, "temperature": 0})["usage"]
        assert usage["completion_tokens"] > 0
    endpoint = metrics_endpoint(server.home)
    hits = wait_for_series(endpoint, "xinference:xavier_requests_with_hits_total", 2, 30)
    deadline = time.monotonic() + 30
    while sum(v for _, v in hits) < 1 and time.monotonic() < deadline:
        time.sleep(1)  # replicas send their counters every few seconds
        hits = wait_for_series(endpoint, "xinference:xavier_requests_with_hits_total", 2, 5)
    print("xavier_requests_with_hits per replica:", hits)
    assert sum(v for _, v in hits) == 1
    blocks = wait_for_series(endpoint, "xinference:xavier_hit_blocks_total", 2, 5)
    assert sum(v for _, v in blocks) >= 2500 // 4 // 16

    page.get_by_text("Running Models", exact=True).first.click()
    page.get_by_text(MODEL).first.wait_for(timeout=30_000)
    page.wait_for_timeout(2000)
    page.screenshot(path=os.path.join(out, "web-ui-running-model.png"))

    assert server.call("DELETE", f"/v1/models/{MODEL}") is None
    assert server.engines_gone() == []
