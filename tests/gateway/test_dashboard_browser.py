"""The admin dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium): sign in, a tenant's cost chart with the right total, create a key (shown once) and
revoke it, a tenant's key cannot sign in. Saves a screenshot in the test's tmp dir; set
TOLLGATE_DASHBOARD_SCREENSHOT=docs/dashboard.png to also copy it there."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session

from billing.accounts import hash_key
from billing.models import ApiKey
from tests.billing.dbutil import fresh_database
from tests.gateway.test_dashboard import EVIL_TENANT, SEEDED, Dashboard, _serve, chart_total
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


@pytest.fixture
def browser(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never try to download a driver
    options = Options()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
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
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # elements looked up mid-navigation can vanish or go stale: those count as "not yet"
    WebDriverWait(driver, 10, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(
        condition)


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
    today = sum(cost for _, ago, cost in SEEDED if ago == 0)
    assert today == 0.625 and browser.find_element(By.ID, "spend-today").text == "$0.625"

    browser.find_element(By.LINK_TEXT, "Tenants").click()
    browser.find_element(By.LINK_TEXT, EVIL_TENANT).click()  # the name is text, never markup
    assert browser.find_element(By.ID, "chart-tenant").text == EVIL_TENANT
    assert chart_total(EVIL_TENANT) == 0.75 and browser.find_element(By.ID, "chart-total").text == "$0.75"
    browser.find_element(By.LINK_TEXT, "acme").click()
    wait_for(browser, lambda b: b.find_element(By.ID, "chart-tenant").text == "acme")
    assert chart_total("acme") == 2.6875 and browser.find_element(By.ID, "chart-total").text == "$2.6875"
    bars = browser.find_elements(By.CSS_SELECTOR, "#tenant-chart svg rect.bar")
    assert len(bars) == 30 and sum(float(b.get_attribute("height")) > 0 for b in bars) == 3
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if envs.get("TOLLGATE_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, envs.get("TOLLGATE_DASHBOARD_SCREENSHOT"))

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
    with Session(d.db) as s:
        assert s.get(ApiKey, row.id).revoked

    browser.find_element(By.ID, "sign-out").click()
    wait_for(browser, lambda b: b.current_url.endswith("/admin/login"))
    browser.get(url + "/admin/keys")
    assert browser.current_url.endswith("/admin/login")
