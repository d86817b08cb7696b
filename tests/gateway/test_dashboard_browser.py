"""The admin dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium), one browser for the module: sign in, a tenant's cost chart with the right total, create a key
(shown once) and revoke it, a tenant's key cannot sign in; then every spend view (overview stacked by
tenant and by model, usage by tag and by end user, budgets of tenants, keys, end users and tags with their soft
alerts, GPU, cache, the overview's cache cards, models' prices, request log) with its numbers, and a click from an
invoice line to the requests behind it. Saves a screenshot of each view in the test's tmp dir; set
TOLLGATE_DASHBOARD_SCREENSHOT=docs/dashboard.png to also copy the overview's there."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from billing.accounts import hash_key
from billing.models import ApiKey
from billing.money import dollars, usd
from tests.billing.dbutil import fresh_database
from tests.gateway.dashboard_seed import BIG, EVIL_TENANT, EVIL_USER, MODEL, SCOPED, SEEDED, chart_total, this_month
from tests.gateway.test_dashboard import Dashboard, _serve
from tollgate import envs

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="needs Debian's chromium and chromium-driver on PATH "
                                       "(apt-get install chromium chromium-driver)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1000"]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[Dashboard]:
    with fresh_database(tmp_path_factory.mktemp("browserdb")) as url:
        yield from _serve(url)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):  # type: ignore[no-untyped-def]
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium') / 'profile'}"]:
        options.add_argument(flag)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # Selenium Manager must never try to download a driver
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.implicitly_wait(5)
    yield driver
    driver.quit()


def sign_in(driver, url: str, key: str) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    driver.get(url + "/admin/login")
    form = driver.find_element(By.ID, "sign-in")
    driver.find_element(By.ID, "key").send_keys(key)
    form.click()
    wait_for(driver, lambda d: _stale(form))  # the click only starts the navigation


def wait_for(driver, condition) -> None:  # type: ignore[no-untyped-def]
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def settled(d) -> bool:  # type: ignore[no-untyped-def]
        try:
            return condition(d)
        except WebDriverException as e:
            # Chromium 156 reports an element read while its page is being replaced as this, not as stale
            if "does not belong to the document" in str(e):
                return False
            raise

    # elements looked up mid-navigation can vanish or go stale: those count as "not yet"
    WebDriverWait(driver, 10, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(
        settled)


def _stale(element) -> bool:  # type: ignore[no-untyped-def]
    """True once the page that held `element` has been replaced."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        element.is_enabled()
        return False
    except StaleElementReferenceException:
        return True
    except WebDriverException as e:  # Chromium, caught mid-swap, says so in its own words
        if "does not belong to the document" in str(e):
            return True
        raise


def test_dashboard_in_chromium(dashboard, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    d, url = dashboard, dashboard.url
    browser.get(url + "/admin")
    assert browser.current_url.endswith("/admin/login")

    sign_in(browser, url, d.tenant_key)  # a tenant's API key is refused
    assert "not an admin key" in browser.find_element(By.CLASS_NAME, "error").text
    assert browser.current_url.endswith("/admin/login")

    sign_in(browser, url, d.admin_key)
    assert browser.current_url == url + "/admin"
    today = sum(s.cost_usd for s in SEEDED if s.ago == 0)
    assert browser.find_element(By.ID, "spend-today").text == usd(today)

    browser.find_element(By.LINK_TEXT, "Tenants").click()
    browser.find_element(By.LINK_TEXT, EVIL_TENANT).click()  # the name is text, never markup
    assert browser.find_element(By.ID, "chart-tenant").text == EVIL_TENANT
    assert chart_total(EVIL_TENANT) == 0.75 and browser.find_element(By.ID, "chart-total").text == "$0.75"
    browser.find_element(By.LINK_TEXT, "acme").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "chart-tenant").text == "acme")
    assert chart_total("acme") == 2.6875 and browser.find_element(By.ID, "chart-total").text == "$2.6875"
    bars = browser.find_elements(By.CSS_SELECTOR, "#tenant-chart svg rect.bar")
    assert len(bars) == 30 and sum(float(b.get_attribute("height")) > 0 for b in bars) == 3
    screenshot(browser, tmp_path / "tenants.png")

    browser.find_element(By.LINK_TEXT, "Keys").click()
    Select(browser.find_element(By.ID, "create-tenant")).select_by_visible_text("acme")
    browser.find_element(By.ID, "create-name").send_keys("from the browser")
    browser.find_element(By.ID, "create-submit").click()
    key = browser.find_element(By.ID, "new-key").text
    with Session(d.db) as s:
        row = s.query(ApiKey).filter(ApiKey.key_hash == hash_key(key)).one()
        assert row.name == "from the browser" and not row.revoked
    browser.get(url + "/admin/keys")  # shown once: not on the next view
    assert key not in browser.page_source and not browser.find_elements(By.ID, "new-key")

    browser.find_element(By.CSS_SELECTOR, f"#key-{row.id} button.revoke").click()
    assert "Key revoked." in browser.find_element(By.CLASS_NAME, "notice").text
    assert browser.find_element(By.CSS_SELECTOR, f"#key-{row.id} .status").text == "revoked"
    assert browser.find_element(By.CSS_SELECTOR, f"#key-{d.keys['ci']} .alert-at").text == "50.0% ($2.50)"
    screenshot(browser, tmp_path / "keys.png")
    with Session(d.db) as s:
        assert s.get(ApiKey, row.id).revoked

    browser.find_element(By.ID, "sign-out").click()
    wait_for(browser, lambda b: b.current_url.endswith("/admin/login"))
    browser.get(url + "/admin/keys")
    assert browser.current_url.endswith("/admin/login")


def screenshot(driver, path: Path) -> Path:  # type: ignore[no-untyped-def]
    """The whole page: the window grown to the page's height for the shot, then back."""
    height, chrome = driver.execute_script(
        "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]")
    driver.set_window_size(1280, max(1000, min(int(height) + int(chrome), 4000)))
    try:
        assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
    finally:
        driver.set_window_size(1280, 1000)
    return path


def texts(driver, css: str) -> list[str]:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def test_spend_views_in_chromium(dashboard, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    d, url = dashboard, dashboard.url
    sign_in(browser, url, d.admin_key)
    last_30 = [s for s in SEEDED if s.ago < 30]

    # the overview: spend per day across all tenants, stacked by tenant, then by model
    assert browser.find_element(By.ID, "spend-total").text == usd(sum(s.cost_usd for s in last_30))
    assert set(texts(browser, "#spend-chart .legend li")) == {s.tenant for s in last_30}
    stacks = {(s.day, s.tenant) for s in last_30 if s.cost_usd > 0}
    assert len(browser.find_elements(By.CSS_SELECTOR, "#spend-chart rect.segment")) == len(stacks)
    shot = screenshot(browser, tmp_path / "overview.png")
    if envs.get("TOLLGATE_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, envs.get("TOLLGATE_DASHBOARD_SCREENSHOT"))
    browser.find_element(By.ID, "by-model").click()
    wait_for(browser, lambda b: set(texts(b, "#spend-chart .legend li")) == {MODEL, BIG})
    screenshot(browser, tmp_path / "overview-by-model.png")

    # usage by tag, narrowed to one tenant with the filter form
    browser.find_element(By.LINK_TEXT, "Usage").click()
    browser.find_element(By.LINK_TEXT, "tag").click()
    Select(browser.find_element(By.ID, "f-tenant")).select_by_visible_text("globex")
    browser.find_element(By.ID, "f-apply").click()
    globex = [s for s in SEEDED if s.tenant == "globex"]
    expected = {tag: usd(sum(s.cost_usd for s in globex if tag in s.tags)) for tag in ("billing", "batch")}
    wait_for(browser, lambda b: {r.find_element(By.CLASS_NAME, "group").text: r.find_element(By.CLASS_NAME, "cost").text
                                 for r in b.find_elements(By.CSS_SELECTOR, "#usage tbody tr")} == expected)
    screenshot(browser, tmp_path / "usage-by-tag.png")

    # by end user: acme's alice and beta's alice are two people, each row naming its tenant and linking to its requests
    browser.get(url + "/admin/usage?by=user")
    alices = {r.find_element(By.CLASS_NAME, "tenant").text: r
              for r in browser.find_elements(By.CSS_SELECTOR, "#usage tbody tr")
              if r.find_element(By.CLASS_NAME, "group").text == "alice"}
    beta = [s for s in SEEDED if s.tenant == "beta" and s.user == "alice"]
    assert set(alices) == {"acme", "beta"}
    assert alices["beta"].find_element(By.CLASS_NAME, "cost").text == usd(sum(s.cost_usd for s in beta))
    screenshot(browser, tmp_path / "usage-by-user.png")
    alices["beta"].find_element(By.CLASS_NAME, "log-link").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "total-requests").text == str(len(beta)))
    assert Select(browser.find_element(By.ID, "f-tenant")).first_selected_option.text == "beta"
    assert browser.find_element(By.ID, "f-user").get_attribute("value") == "alice"
    dates = browser.find_element(By.ID, "f-dates").text  # what the To field means, and what the CLI's --until does
    assert "Both days are included" in dates and "first day not counted" in dates

    # budgets: spent and the reservations of the requests in flight
    browser.find_element(By.LINK_TEXT, "Budgets").click()
    ci = browser.find_element(By.ID, f"budget-key-{d.keys['ci']}")
    assert ci.find_element(By.CLASS_NAME, "reserved-usd").text == "$0.375 (2 requests)"
    assert ci.find_element(By.CLASS_NAME, "spent-usd").text == usd(
        sum(s.cost_usd for s in SEEDED if s.key == "ci" and this_month(s)))
    # end-user and tag budgets beside them: one row each, names as text, and a link to their requests
    scoped = {(r.get_attribute("data-scope"), r.find_element(By.CLASS_NAME, "name").text,
               r.find_element(By.CLASS_NAME, "hint").text): r
              for r in browser.find_elements(By.CSS_SELECTOR, "#budgets tr.budget") if
              r.get_attribute("data-scope") in ("user", "tag")}
    assert set(scoped) == {(scope, name, f"({tenant})") for tenant, scope, name, _ in SCOPED}
    alice = [s for s in SEEDED if s.tenant == "acme" and s.user == "alice" and this_month(s)]
    row = scoped[("user", "alice", "(acme)")]
    assert row.find_element(By.CLASS_NAME, "spent-usd").text == usd(sum(s.cost_usd for s in alice))
    assert row.find_element(By.CLASS_NAME, "reserved-usd").text == "$0.25 (1 request)"
    assert row.find_element(By.CLASS_NAME, "left").text == usd(1 - sum(s.cost_usd for s in alice) - dollars("0.25"))
    assert scoped[("tag", "search", "(acme)")].find_element(By.CLASS_NAME, "reserved-usd").text == "$0.375 (2 requests)"
    assert scoped[("user", EVIL_USER, f"({EVIL_TENANT})")].find_element(By.CLASS_NAME, "used").text == "100.0%"
    assert scoped[("user", "alice", "(initech)")].find_element(By.CLASS_NAME, "spent-usd").text == "$0.00"
    # soft budgets: the share and the spend at which the alert fires, and a tick on the meter
    assert ci.find_element(By.CLASS_NAME, "alert-at").text == "alert at 50.0% ($2.50)"
    assert row.find_element(By.CLASS_NAME, "alert-at").text == "alert at 90.0% ($0.90)"
    assert len(ci.find_elements(By.CSS_SELECTOR, "svg.meter line.alert-tick")) == 1
    screenshot(browser, tmp_path / "budgets.png")
    row.find_element(By.CLASS_NAME, "log-link").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "total-requests").text == str(len(alice)))
    assert sorted(r.get_attribute("data-request-id") for r in browser.find_elements(By.CSS_SELECTOR, "#requests tr.request")
                  ) == sorted(f"seed-{SEEDED.index(s)}" for s in alice)
    screenshot(browser, tmp_path / "requests-of-a-budget.png")
    browser.back()

    browser.find_element(By.LINK_TEXT, "GPU").click()
    assert texts(browser, "#gpu tr.gpu-tenant .total") == ["300 s", "249.75 s", "60 s", "50.25 s"]
    assert [texts(browser, f"#gpu tr.gpu-all .{c}") for c in ("busy", "idle", "total", "cost")] == [
        ["192.5 s"], ["467.5 s"], ["660 s"], ["$0.25"]]
    sizes = {browser.find_element(By.CSS_SELECTOR, f"#gpu tr.gpu-tenant td.{c}").value_of_css_property("font-size")
             for c in ("busy", "idle", "total", "cost")}
    assert len(sizes) == 1, sizes  # the Total column in the table's own font
    screenshot(browser, tmp_path / "gpu.png")

    browser.find_element(By.LINK_TEXT, "Cache").click()
    hits = [s for s in SEEDED if s.cache_hit]
    assert browser.find_element(By.ID, "saved-semantic").text == usd(
        sum(dollars((s.prompt * 2 + s.completion * 6) / 1_000_000) for s in hits))  # all on big-model
    # the semantic cache per tenant: its bound (the default here), hits of its requests, no flags without a cache
    rows = browser.find_elements(By.CSS_SELECTOR, "#cache-bounds tbody tr")
    by_tenant = {r.get_attribute("data-tenant"): r for r in rows}
    for tenant in {s.tenant for s in hits}:
        cells = by_tenant[tenant].find_elements(By.TAG_NAME, "td")
        assert cells[1].text == "1.0% (default)"
        assert cells[3].text.startswith(f"{sum(1 for s in hits if s.tenant == tenant):,} ")
    assert texts(browser, "#cache-flags td") == ["No answer was flagged."]
    screenshot(browser, tmp_path / "cache.png")

    # the overview's cache cards: the semantic cache's hits and savings, the prefix cache's tokens and savings, apart
    browser.find_element(By.LINK_TEXT, "Overview").click()
    month = [s for s in SEEDED if this_month(s)]
    month_hits = [s for s in month if s.cache_hit]
    assert browser.find_element(By.ID, "semantic-hits").text == str(len(month_hits))
    assert browser.find_element(By.ID, "semantic-saved").text == usd(
        sum(dollars((s.prompt * 2 + s.completion * 6) / 1_000_000) for s in month_hits))
    cached = sum(s.cached for s in month if not s.cache_hit)  # on big-model only: $2 − $0.5 per 1M cheaper
    assert browser.find_element(By.ID, "prefix-tokens").text == f"{cached:,}"
    assert browser.find_element(By.ID, "prefix-saved").text == usd(dollars(cached * 1.5 / 1_000_000))
    screenshot(browser, tmp_path / "overview-cards.png")

    browser.find_element(By.LINK_TEXT, "Models").click()
    assert texts(browser, "#models td.cached-price") == ["$0.50", "$0.05 (as input)"]
    screenshot(browser, tmp_path / "models.png")

    # an invoice line, clicked through to the requests behind it
    browser.find_element(By.LINK_TEXT, "Invoices").click()
    Select(browser.find_element(By.ID, "f-tenant")).select_by_visible_text("globex")
    browser.find_element(By.ID, "f-apply").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "invoice-tenant").text == "globex")
    screenshot(browser, tmp_path / "invoice.png")
    line = browser.find_element(By.CSS_SELECTOR, f'tr.invoice-line[data-kind="output"][data-model="{MODEL}"]')
    behind = [s for s in globex if s.model == MODEL and not s.cache_hit and this_month(s)]
    completion = sum(s.completion for s in behind)
    assert line.find_element(By.CLASS_NAME, "quantity").text == f"{completion:,} tokens"
    assert line.find_element(By.CLASS_NAME, "exact").text == usd(dollars(completion * 0.1 / 1_000_000))  # $0.10 per 1M
    line.find_element(By.CLASS_NAME, "events-link").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "total-completion").text == f"{completion:,}")
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tr.request")
    assert sorted(r.get_attribute("data-request-id") for r in rows) == sorted(
        f"seed-{SEEDED.index(s)}" for s in behind)
    assert Select(browser.find_element(By.ID, "f-tenant")).first_selected_option.text == "globex"
    assert Select(browser.find_element(By.ID, "f-cache")).first_selected_option.text == "miss"
    screenshot(browser, tmp_path / "requests.png")

    # the log's own filters: another tenant's failed requests
    Select(browser.find_element(By.ID, "f-tenant")).select_by_visible_text("initech")
    Select(browser.find_element(By.ID, "f-model")).select_by_visible_text("any")
    Select(browser.find_element(By.ID, "f-cache")).select_by_visible_text("any")
    Select(browser.find_element(By.ID, "f-status")).select_by_visible_text("failed")
    browser.find_element(By.ID, "f-until").clear()
    browser.find_element(By.ID, "f-since").clear()
    browser.find_element(By.ID, "f-apply").click()
    failed = [s for s in SEEDED if s.tenant == "initech" and s.status == "failed"]
    wait_for(browser, lambda b: b.find_element(By.ID, "total-requests").text == str(len(failed)))
    assert texts(browser, "#requests tr.request td:nth-child(7) .state") == ["failed"] * len(failed)
