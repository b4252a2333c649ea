"""The API docs work without internet: ``/docs`` and ``/redoc`` reference only assets the API serves
itself (FastAPI's defaults load Swagger UI and ReDoc from a CDN: a blank page offline), and those assets
are served. The OpenAPI document carries the package's version and names JobCreate's variants."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

pytestmark = pytest.mark.integration


def _references(html: str) -> list[str]:
    """Every URL a docs page loads: script/link/img targets and the OpenAPI document's URL."""
    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html) + \
        re.findall(r"""(?:url:|spec-url=)\s*["']([^"']+)["']""", html)


@pytest.mark.parametrize(("page", "needs"), [("/docs", ("swagger-ui-bundle.js", "swagger-ui.css")),
                                             ("/redoc", ("redoc.standalone.js",))])
def test_docs_pages_load_only_local_assets(client, page, needs):
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    refs = _references(r.text)
    assert "/openapi.json" in refs, refs
    remote = [u for u in refs if not u.startswith("/")]
    assert not remote, f"{page} loads from outside the API: {remote}"
    assert not re.search(r"https?://", r.text), "an absolute URL in the page"
    for name in needs:
        assert any(u.endswith("/" + name) for u in refs), (name, refs)
    for url in refs:
        asset = client.get(url)
        assert asset.status_code == 200, url
        if url.endswith(".js"):
            assert "javascript" in asset.headers["content-type"] and len(asset.content) > 100_000, url
        if url.endswith(".css"):
            assert asset.headers["content-type"].startswith("text/css"), url


def test_openapi_version_and_named_job_variants(client):
    spec = client.get("/openapi.json").json()
    assert spec["info"]["version"] == version("inferq")
    variants = spec["components"]["schemas"]["JobCreate"]["oneOf"]
    assert [v["title"] for v in variants] == ["JobCreate with prompt", "JobCreate with messages",
                                             "JobCreate with prompt_ids"]
